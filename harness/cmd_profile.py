"""`harness profile`: time NS calls and optimizer passes on this machine -> a cost-table CSV.

  harness profile --device cpu --workload qwen2.5-7b --scale 0.03125,0.0625,0.125 --out FILE

torch is imported inside the command.
"""

from __future__ import annotations

import json
import sys

from .cmd_plan import _csv_list, _fraction, load_matrices

CPU_PROFILE_SCALES = (1 / 32, 1 / 16, 1 / 8)


def register(app, bench) -> None:
    import typer

    @app.command("profile")
    def profile_cmd(
        device: str = typer.Option("cpu", help="cpu | cuda"),
        workload: str = typer.Option("qwen2.5-7b", help="Whose Muon matrix shapes to time."),
        scale: str = typer.Option(
            None,
            help="Width scale(s) of the workload, comma list, e.g. 1/32,1/16,1/8 "
            "(default: those on cpu, 1 on cuda).",
        ),
        methods: str = typer.Option(
            None,
            help="Comma list of standard | standard_sym | gram | gram_sym "
            "(default: standard,gram on cpu; all four on cuda).",
        ),
        dtype: str = typer.Option(
            None, help="Comma list of bf16 | fp16 | fp32 (default on cpu: fp32 and the half types it "
            "multiplies natively, e.g. bf16 with AVX512-BF16; bf16,fp16 on cuda)."
        ),
        max_batch: int = typer.Option(8, help="Batch sizes 1..max_batch."),
        repeats: int = typer.Option(3, help="Timed repeats per point (median), after one warm-up; NS "
                                            "points are timed in that many interleaved rounds."),
        threads: int = typer.Option(1, help="torch CPU threads (1 matches the multi-process CPU runs)."),
        device_name: str = typer.Option(
            None, help="Device column: a800 | h200 | ... (default: from the GPU name on cuda, 'cpu' on cpu)."
        ),
        out: str = typer.Option(None, help="Write the profile CSV here (atomically)."),
        keep_faster_than: str = typer.Option(
            None,
            "--keep-faster",
            help="Merge with this earlier profile: per point the faster of the two "
            "(a shared machine's contention only slows runs down).",
        ),
        json_out: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
    ):
        """Time NS calls (batch 1..max_batch) and optimizer passes on this machine -> a cost profile CSV."""
        import time

        import torch

        from dmuon.errors import InputError, choice_error
        from dmuon.plan.profile import cpu_dtypes, default_device_name, ns_shapes_of, profile_device
        from dmuon.plan.profile_io import format_rows, keep_faster, read_profile, write_profile

        if device not in ("cpu", "cuda"):
            raise choice_error("device", device, ("cpu", "cuda"))
        if device == "cuda" and not torch.cuda.is_available():
            raise InputError("--device cuda, but torch sees no CUDA GPU here; accepted: cpu")
        if threads < 1:
            raise InputError(f"--threads must be a positive integer, got {threads}")
        earlier = read_profile(keep_faster_than) if keep_faster_than else None  # read before the timing

        scales = [_fraction(x) for x in _csv_list(scale, "--scale")] or (
            list(CPU_PROFILE_SCALES) if device == "cpu" else [1.0]
        )
        meths = tuple(_csv_list(methods, "--methods")) or (
            ("standard", "gram") if device == "cpu" else ("standard", "standard_sym", "gram", "gram_sym")
        )
        dtypes = tuple(_csv_list(dtype, "--dtype")) or (cpu_dtypes() if device == "cpu" else ("bf16", "fp16"))
        if device == "cpu":
            torch.set_num_threads(threads)
        shapes = set()
        for f in scales:
            shapes |= {m.shape for m in load_matrices(workload, f if f != 1.0 else None).muon_matrices}
        t0 = time.perf_counter()
        rows = profile_device(
            ns_shapes_of(shapes),
            device=device,
            methods=meths,
            dtypes=dtypes,
            max_batch=max_batch,
            repeats=repeats,
            device_name=device_name or default_device_name(device),
            progress=None if json_out else (lambda s: print(s, file=sys.stderr)),
        )
        if earlier is not None:
            rows = keep_faster(rows, earlier)
        if out:
            write_profile(out, rows)
        if json_out:
            print(json.dumps([r.__dict__ for r in rows], indent=1))
        else:
            print(format_rows(rows), end="")
            print(
                f"{len(rows)} rows in {time.perf_counter() - t0:.1f} s"
                + (f", written to {out}" if out else ""),
                file=sys.stderr,
            )
