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
    host_cores: Annotated[Optional[int], typer.Option("--host-cores", min=1, help="CPU captures: cores the ranks shared (default: this machine's, if it captured them).")] = None,
    no_host_fit: Annotated[bool, typer.Option("--no-host-fit", help="Do not fit the host overhead per kernel from train bundles' step times.")] = False,
    collective: Annotated[Optional[str], typer.Option("--collective", help="Collective of nccl-tests logs that do not name it (all_reduce, all_gather, ...).")] = None,
    scenario: Annotated[Optional[Path], typer.Option("--scenario", help="Scenario YAML whose parallel layout tells the groups of collectives the traces do not record.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout (the profile written, its path, the notes and warnings) instead of the tables.")] = False,
) -> None:
    """Fit a profile (compute, communication, overlap, provenance) from captured timings."""
    from simulator.calibrate.fit import calibrate
    from simulator.files import check_outputs, write_atomic

    if out.suffix != ".json":
        raise UserError(f"--out {str(out)!r} must be a .json file, e.g. calibration/my-gpu.json")
    if out.exists() and not force:
        raise UserError(f"--out {str(out)!r} already exists: choose another path or pass --force")
    # --force replaces an earlier profile (--base may be it), never a trace, log or bundle file read here.
    check_outputs({"--out": out}, [("scenario file", scenario), *(("trace input", i) for i in inputs)])
    from simulator.trace.nccl_tests import check_collective_name

    check_collective_name(collective)
    _refuse_repeated_inputs(inputs)
    if inputs and all(Path(i).suffix == ".csv" for i in inputs):
        # Per-operator latency tables (NeuSight's or plain): fit the kernel model's constants.
        from simulator.workload.kernel_model import calibrate_from_tables
        from simulator.profile import load_profile
        from simulator.trace.optable_csv import load_op_table

        from simulator.workload.kernel_model import normalize_dtype

        tables = [load_op_table(i) for i in inputs]
        prof = calibrate_from_tables(tables, load_profile(base) if base else None)
        fitted_dtypes = {normalize_dtype(t.dtype) for t in tables}
        prof = prof.model_copy(update={"name": name or out.stem})
        write_atomic(out, prof.model_dump_json(indent=2, exclude_none=True) + "\n")
        if as_json:
            _print_json(prof, out, [], [])
            return
        km = prof.compute.kernels
        # (only the dtypes the tables timed: the others are the base's, not fitted)
        print(f"{prof.name}: {prof.device}: GEMM efficiency {', '.join(f'{k} {v:.2f}' for k, v in km.gemm_efficiency.items() if k in fitted_dtypes)}, "
              f"K overhead {km.gemm_k_overhead:.1f} (per-tile cost, in elements of K), "
              f"launch floor {km.launch_floor_us:.1f} us, HBM efficiency {', '.join(f'{k} {v:.2f}' for k, v in km.mem_efficiency.items())}; "
              f"median |op error| {', '.join(f'{k} {v:.0%}' for k, v in (km.fit_error or {}).items())}; wrote {out}", file=sys.stderr)
        if km.fit_source and "low confidence" in km.fit_source:
            print(f"note: {km.fit_source.split('; low confidence: ', 1)[1]} (the fit wanted beyond physics; "
                  f"the bound is used)", file=sys.stderr)
        return
    if any(Path(i).suffix == ".csv" for i in inputs):
        raise UserError("op tables (.csv) calibrate on their own: give only .csv inputs, or only traces and logs")
    from simulator.calibrate.physics import Notes

    mesh = None
    if scenario is not None:
        from simulator.scenario import load_scenario
        from simulator.workload.plan import mesh_of

        sc = load_scenario(scenario)
        p = sc.parallelism
        mesh = mesh_of(sc)
    notes = Notes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = calibrate(list(inputs), name or out.stem, base=base, topology=topology, fit_host=not no_host_fit,
                         host_cores=host_cores, notes=notes, mesh=mesh, collective=collective)
    warned: list[str] = []
    for w in caught:
        msg = str(w.message)
        if msg not in warned:  # one readable line each, never the source line
            warned.append(msg)
    write_atomic(out, prof.model_dump_json(indent=2, exclude_none=True) + "\n")
    if as_json:
        _print_json(prof, out, notes.lines, warned)
        return
    for line in notes.lines:
        print(f"note: {line}", file=sys.stderr)
    for msg in warned:
        print(f"warning: {msg}", file=sys.stderr)
    _summary(prof, out)


def _refuse_repeated_inputs(inputs: list[Path]) -> None:
    """One input given twice (the same path, a file inside a folder also given, or two files with
    the same bytes: a copied log, overlapping globs) would count its samples twice and weight the
    fit towards it, silently."""
    import hashlib

    seen: dict[Path, Path] = {}  # resolved -> as given
    for given in inputs:
        try:
            resolved = Path(given).resolve()
        except (OSError, RuntimeError):
            continue  # an unreadable path is refused, by name, where it is read
        if resolved in seen:
            also = "" if str(seen[resolved]) == str(given) else f" (also as {str(seen[resolved])!r})"
            raise UserError(f"input {str(given)!r} is given twice{also}: pass each trace or log once")
        seen[resolved] = Path(given)
    folders = {r for r, given in seen.items() if given.is_dir()}
    for resolved, given in seen.items():
        inside = next((f for f in resolved.parents if f in folders), None)
        if inside is not None:
            raise UserError(f"input {str(given)!r} is inside the folder {str(seen[inside])!r}, also given: "
                            f"pass the folder or the files in it, not both")
    import gzip

    from simulator.trace.jsonstream import GZIP_MAGIC, open_bytes

    def content_size(path: Path) -> int:
        # The bytes a reader sees: a gzip file's ISIZE (its last 4 bytes: the content's size mod
        # 2^32), so trace.json and trace.json.gz of one trace meet; hashed only on a match.
        with open(path, "rb") as fh:
            if fh.read(2) != GZIP_MAGIC:
                return path.stat().st_size
            fh.seek(-4, 2)
            return int.from_bytes(fh.read(4), "little")

    by_size: dict[int, list[Path]] = {}
    for given in seen.values():
        try:
            if given.is_file():
                by_size.setdefault(content_size(given), []).append(given)
        except OSError:
            continue
    for same_size in by_size.values():
        by_digest: dict[str, Path] = {}
        for given in same_size if len(same_size) > 1 else ():
            digest = hashlib.sha256()
            try:
                with open_bytes(given) as fh:
                    for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                        digest.update(chunk)
            except (OSError, EOFError, gzip.BadGzipFile):
                continue
            other = by_digest.setdefault(digest.hexdigest(), given)
            if other is not given:
                raise UserError(f"input {str(given)!r} holds the same content as {str(other)!r}: "
                                f"pass each trace or log once (a copy counts its samples twice)")


def _print_json(prof, out: Path, notes: list[str], warned: list[str]) -> None:
    import json

    print(json.dumps({"out": str(out), "notes": list(notes), "warnings": warned,
                      "profile": prof.model_dump(mode="json", exclude_none=True)}))


def _summary(prof, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from simulator.textsafe import for_rich

    con = Console(stderr=True)
    # (the name and device come from the user's flags and files: no markup, no control characters)
    name, device = for_rich(prof.name), for_rich(prof.device)
    fitted = {cls: m for cls, m in prof.compute.classes.items() if m.fit_samples}
    if fitted:  # (from nccl-tests logs alone, every class is the base profile's: no table of them)
        t = Table(title=f"{name}: {device}")
        for c in ("op class", "basis", "ops", "overhead", "held-out error"):
            t.add_column(c)
        for cls, m in fitted.items():
            t.add_row(cls, m.basis, str(m.fit_samples), f"{m.overhead_us:.1f} us",
                      "-" if m.fit_error is None else f"{m.fit_error:.1%}")
        con.print(t)
    else:
        con.print(f"{name}: {device}: compute as the base profile (the inputs time no compute ops)")
    if prof.comm.collectives:
        c = Table(title="collectives")
        for col in ("collective", "group", "tier", "alpha", "sizes", "held-out error"):
            c.add_column(col)
        for f in prof.comm.collectives:
            c.add_row(f.collective, str(f.group_size), f.tier, f"{f.alpha_us:.1f} us", str(len(f.table_bytes)),
                      "-" if f.fit_error is None else f"{f.fit_error:.1%}")
        con.print(c)
    from simulator.network.nccl import gpu_generation

    # (on a GPU NCCL's model describes, simulate times collectives with it: the efficiencies are not read)
    unread = " (link efficiencies not read on this GPU: collectives take NCCL's model, comm.nccl)" \
        if gpu_generation(prof.device) is not None else ""
    con.print(f"nvlink_efficiency {prof.comm.nvlink_efficiency:.3f}, nic_efficiency {prof.comm.nic_efficiency:.3f}, "
              f"overlap_slowdown {prof.compute.overlap_slowdown:.3f}{unread}")
    if prof.comm.nccl is not None:
        n = prof.comm.nccl
        con.print(f"NCCL model ({for_rich(n.system)}): " + ", ".join(f"{k} {v:.3g}" for k, v in n.model_dump(exclude={"system", "fit_error", "product_only"}).items() if v is not None)
                  + "; worst error per log: " + ", ".join(f"{k} {v:.1%}" for k, v in n.fit_error.items())
                  + "".join(f"; fixed only as a product: {a} x {b} = {getattr(n, a) * getattr(n, b):.3g}" for a, b in n.product_only))
    con.print(f"wrote {for_rich(out)}")


calibrate_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
calibrate_app.command("calibrate")(calibrate_command)
