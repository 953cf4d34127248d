"""``clustersim calibrate BUNDLE_OR_TRACE... --out calibration/<name>.json``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

from simulator.errors import UserError


def calibrate_command(
    inputs: Annotated[list[Path], typer.Argument(help="Trace bundles, Kineto traces (.json/.json.gz, or folders of them), nccl-tests logs.")],
    out: Annotated[Path, typer.Option("--out", help="Profile JSON to write, e.g. calibration/<name>.json.")],
    base: Annotated[Optional[str], typer.Option("--base", help="Profile whose numbers fill what the inputs do not measure.")] = None,
    topology: Annotated[Optional[str], typer.Option("--topology", help="Topology the link efficiencies refer to; default from the device.")] = None,
    name: Annotated[Optional[str], typer.Option("--name", help="Profile name; default the --out file's stem.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out.")] = False,
    host_cores: Annotated[Optional[int], typer.Option("--host-cores", help="CPU captures: cores the ranks shared (default: this machine's, if it captured them).")] = None,
    no_host_fit: Annotated[bool, typer.Option("--no-host-fit", help="Do not fit the host overhead per kernel from train bundles' step times.")] = False,
) -> None:
    """Fit a profile (compute, communication, overlap, provenance) from captured timings."""
    from simulator.calibrate.fit import calibrate
    from simulator.files import write_atomic

    if out.suffix != ".json":
        raise UserError(f"--out {str(out)!r} must be a .json file, e.g. calibration/my-gpu.json")
    if out.exists() and not force:
        raise UserError(f"--out {str(out)!r} already exists: choose another path or pass --force")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = calibrate(list(inputs), name or out.stem, base=base, topology=topology, fit_host=not no_host_fit,
                         host_cores=host_cores)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    write_atomic(out, prof.model_dump_json(indent=2, exclude_none=True) + "\n")
    _summary(prof, out)


def _summary(prof, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(stderr=True)
    t = Table(title=f"{prof.name}: {prof.device}")
    for c in ("op class", "basis", "ops", "overhead", "held-out error"):
        t.add_column(c)
    for cls, m in prof.compute.classes.items():
        t.add_row(cls, m.basis, str(m.fit_samples or "-"), f"{m.overhead_us:.1f} us",
                  "-" if m.fit_error is None else f"{m.fit_error:.1%}")
    con.print(t)
    if prof.comm.collectives:
        c = Table(title="collectives")
        for col in ("collective", "group", "tier", "alpha", "sizes", "held-out error"):
            c.add_column(col)
        for f in prof.comm.collectives:
            c.add_row(f.collective, str(f.group_size), f.tier, f"{f.alpha_us:.1f} us", str(len(f.table_bytes)),
                      "-" if f.fit_error is None else f"{f.fit_error:.1%}")
        con.print(c)
    con.print(f"nvlink_efficiency {prof.comm.nvlink_efficiency:.3f}, nic_efficiency {prof.comm.nic_efficiency:.3f}, "
              f"overlap_slowdown {prof.compute.overlap_slowdown:.3f}")
    con.print(f"wrote {out}")


calibrate_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
calibrate_app.command("calibrate")(calibrate_command)
