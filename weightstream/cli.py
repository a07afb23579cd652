"""The ``weightstream`` command."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import torch

    from weightstream.converters.fp8 import BlockFP8
    from weightstream.jobs import Layout
    from weightstream.reference_engine.server import EngineServer

DEMO_INPUT = [[1, 17, 42, 256, 999, 3, 511, 64, 128, 7, 900, 12]]

_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _mb(value: str) -> int:
    mb = float(value)
    if mb <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return int(mb * (1 << 20))


def _floats(value: str) -> tuple[float, ...]:
    """A comma-separated list of positive numbers (learning rates)."""
    try:
        out = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {value!r}") from None
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"must be positive numbers, comma-separated: {value!r}")
    return out


def _layout_args(p: argparse.ArgumentParser, tp: int, pp: int) -> None:
    p.add_argument("--tp", type=int, default=tp, help=f"tensor-parallel size of the Megatron model (default {tp})")
    p.add_argument("--pp", type=int, default=pp, help=f"pipeline-parallel size (default {pp})")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (default: none)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size, for mixture-of-experts models (default 1)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size, for mixture-of-experts models (default: the same as --tp)")


def build_parser() -> argparse.ArgumentParser:
    """The ``weightstream`` command line: its global options and the sub-commands of :data:`_COMMANDS`."""
    from weightstream.models.presets import PRESETS

    parser = argparse.ArgumentParser(
        prog="weightstream",
        description="Stream Megatron-Core weights in the Hugging Face layout: to disk, or into inference engines. "
                    "`weightstream families` lists the model types it converts.",
    )
    from weightstream._version import __version__

    parser.add_argument("--version", action="version", version=f"weightstream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also show third-party warnings and progress bars (Megatron-Core, torch, transformers)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    presets = sorted(PRESETS)
    for add_command in _COMMANDS:
        add_command(sub, presets)
    return parser


def _add_demo(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream demo``: the whole path on a tiny model, proven."""
    demo = sub.add_parser(
        "demo",
        help="build a tiny Qwen3, stream it from a local TP×PP job into a reference engine and to disk, prove both",
        description=(
            "Builds a tiny Qwen3 model with random weights, starts a reference engine (TP 2) that does not hold "
            "them, starts local CPU processes (TP 2 × PP 2 by default), loads the weights into a Megatron-Core "
            "model, updates the engine with update_weights (P2P here: engine TP equals trainer TP), writes an HF "
            "checkpoint, and proves it all: every tensor of the checkpoint bit-identical to the source, and the "
            "logits of the Megatron model, of the HF model loaded from the checkpoint and of the engine equal. "
            "Exit status 0 only when proven."
        ),
    )
    demo.add_argument("--preset", default="tiny-qwen3", choices=presets, help="model (default tiny-qwen3)")
    _layout_args(demo, 2, 2)
    demo.add_argument("--bucket-mb", type=_mb, default=_mb("0.25"), help="bucket size in MiB (default 0.25)")
    demo.add_argument("--out", default=None, help="keep the checkpoint here (default: a temporary directory)")
    demo.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    demo.add_argument("--engine-tp", type=int, default=2,
                      help="TP size of the reference engine the demo updates (default 2; 0: no engine, disk only)")


def _add_dump(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream dump``: HF weights into a Megatron model under a layout, streamed to an HF checkpoint."""
    dump = sub.add_parser(
        "dump",
        help="build a Megatron model under a layout from HF weights, stream it, write an HF checkpoint",
        description=(
            "Builds the Megatron-Core model for an HF checkpoint (or a preset with random weights) under the "
            "given parallel layout on local CPU processes, loads the weights, streams them and writes an HF "
            "safetensors checkpoint (shards, index, config.json)."
        ),
    )
    src = dump.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="HF checkpoint directory to start from")
    src.add_argument("--preset", choices=presets, help="a preset config with random weights")
    dump.add_argument("--seed", type=int, default=0, help="seed of the random weights for --preset (default 0)")
    _layout_args(dump, 1, 1)
    dump.add_argument("--bucket-mb", type=_mb, default=_mb("512"), help="bucket size in MiB (default 512)")
    dump.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="Megatron parameter dtype (default float32)")
    dump.add_argument("--writers", default="rank0", choices=["rank0", "spread"],
                      help="who writes the files: global rank 0, or spread over all ranks (default rank0)")
    dump.add_argument("--out", required=True,
                      help="output directory: written beside it and moved into place when complete; must be empty "
                           "or absent unless --overwrite")
    _quantize_args(dump)
    dump.add_argument("--overwrite", action="store_true",
                      help="replace a non-empty --out (whole, in one step, once the new checkpoint is complete)")


def _quantize_args(parser: argparse.ArgumentParser) -> None:
    """``--quantize fp8-block`` and its block and scale format."""
    parser.add_argument("--quantize", choices=["fp8-block"], default=None,
                        help="write the weights the model family declares FP8 as block FP8 (float8 values and "
                             "float32 _scale_inv scales, with quantization_config in config.json)")
    parser.add_argument("--fp8-block", type=_block, default=(128, 128), metavar="ROWSxCOLS",
                        help="the FP8 block (default 128x128)")
    parser.add_argument("--fp8-scales", choices=["float", "ue8m0"], default="float",
                        help="float32 scales as they come, or rounded up to powers of two (ue8m0)")


def _block(text: str) -> tuple[int, int]:
    rows, sep, cols = text.partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) <= 0 or int(cols) <= 0:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS (e.g. 128x128), got {text!r}")
    return int(rows), int(cols)


def _quantize(args: argparse.Namespace) -> BlockFP8 | None:
    from weightstream.converters.fp8 import BlockFP8

    return BlockFP8(args.fp8_block, args.fp8_scales) if args.quantize == "fp8-block" else None


def _add_bench(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream bench``: its three modes (--soak, --transport, --from-json) and their options."""
    bench = sub.add_parser(
        "bench",
        help="measure weightstream: --transport T times one path against the machine's ceiling; "
             "--soak N runs N consecutive updates into a reference engine and checks for leaks",
        description=(
            "--transport stream|broadcast|ipc|p2p|checkpoint: build the --preset model (--tiny: its topology at small "
            "widths; --tp N: a TP-N trainer on N GPUs, the engine's ranks on the next GPUs for broadcast and p2p), "
            "run it cold once and warm --repeats times, and measure the raw ceiling of the same bytes in the same "
            "run (device copy; plain broadcast; plain send/recv of each rank's bytes, all pairs at once; "
            "safetensors' save_file); prints ours, ceiling, ratio, "
            "cold vs warm, peak extra memory and the phase split. "
            "--soak N: N consecutive updates through one WeightSync into a reference engine running as its own "
            "service on this machine, alternating two sets of weights and switching transport every "
            "--switch-every updates, checksums on; the engine's logits are compared with the HF model's every "
            "--check-every updates, and the trainer's and engine's memory, file descriptors, threads and "
            "/dev/shm entries are sampled. Prints one report; exit status 0 only when every update and check "
            "passed (leak thresholds are the caller's to judge, from the report or --json)."
        ),
    )
    what = bench.add_mutually_exclusive_group(required=True)
    what.add_argument("--soak", type=int, metavar="N", help="number of updates")
    what.add_argument("--transport", action="append", choices=["stream", "broadcast", "ipc", "p2p", "checkpoint"],
                      help="path to time (repeatable)")
    what.add_argument("--from-json", nargs="+", metavar="F.json",
                      help="no run: print (and with --plot, chart) the rows saved by earlier --json runs")
    _bench_transport_args(bench)
    _bench_run_args(bench, presets)


def _bench_transport_args(bench: argparse.ArgumentParser) -> None:
    """The options of ``bench --transport`` (and ``--plot``, which ``--from-json`` takes too)."""
    bench.add_argument("--tiny", action="store_true", help="the preset's topology at small widths (CPU-sized)")
    bench.add_argument("--reuse-buffers", action="store_true",
                       help="--transport stream: pack into two kept buffers, as the sinks do (default: fresh buffers)")
    bench.add_argument("--no-rollback", action="store_true",
                       help="--transport ipc/broadcast: the reference engine keeps no backup of its weights during an "
                            "update (as SGLang); by default it keeps one (one more device copy per update)")
    bench.add_argument("--prepare", action="store_true",
                       help="--transport ipc/broadcast/p2p: call WeightSync.prepare() (plan, group) before the first "
                            "update, timed apart; the cold figure is then the first update after it")
    bench.add_argument("--no-direct", action="store_true",
                       help="--transport ipc: pack into buffers the engine copies out of, instead of writing straight "
                            "into the engine's weights where it offers them (to compare)")
    bench.add_argument("--per-bucket", action="store_true",
                       help="--transport ipc/broadcast: one request per bucket, not the metadata of all buckets ahead "
                            "(to compare; what engines without the ahead routes get)")
    bench.add_argument("--delta", action="store_true",
                       help="delta updates on real optimizer steps (broadcast, p2p or ipc): per --lr, --steps "
                            "Adam steps on fp32 masters, each followed by a delta update, against full updates of "
                            "the same weights in the same run")
    bench.add_argument("--lr", type=_floats, default=(1e-6, 1e-5), metavar="LR[,LR...]",
                       help="learning rates of --delta (default 1e-6,1e-5)")
    bench.add_argument("--steps", type=int, default=3, help="optimizer steps per learning rate of --delta (default 3)")
    bench.add_argument("--masters", choices=["device", "host"], default="device",
                       help="where --delta keeps the fp32 master weights and Adam's state (default device)")
    bench.add_argument("--snapshot", choices=["device", "host"], default="device",
                       help="where the sender keeps the bytes it computes deltas against (default device)")
    bench.add_argument("--replicas", type=int, default=1,
                       help="engines updated at once, each of --engine-tp ranks: by broadcast, through one group with "
                            "every engine rank from one trainer; by p2p, from a trainer of as many data-parallel "
                            "replicas, engine j's buckets sent by replica j (default 1)")
    bench.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="(default bfloat16)")
    bench.add_argument("--repeats", type=int, default=3, help="warm runs after the cold one (default 3)")
    bench.add_argument("--plot", default=None, metavar="F.png", help="bar chart of ours vs ceiling (needs matplotlib)")


def _bench_run_args(bench: argparse.ArgumentParser, presets: list[str]) -> None:
    """The options of ``bench --soak``, those of the model, trainer and engine that both runs share, and --json."""
    bench.add_argument("--transports", default="broadcast,ipc",
                       help="comma-separated transports to rotate through (default broadcast,ipc)")
    bench.add_argument("--switch-every", type=int, default=2, help="updates per transport before switching (default 2)")
    bench.add_argument("--preset", default="tiny-qwen3", choices=presets, help="model (default tiny-qwen3)")
    bench.add_argument("--tp", type=int, default=1,
                       help="--transport broadcast/ipc/p2p: the trainer's TP size, one GPU per rank (default 1)")
    bench.add_argument("--ep", type=int, default=1,
                       help="--transport broadcast/ipc/p2p: the trainer's expert-parallel size (MoE presets; the "
                            "trainer then has TP x EP ranks; default 1)")
    bench.add_argument("--engine-tp", type=int, default=None,
                       help="TP size of the reference engine (default: --soak 1, --transport the trainer's TP); with "
                            "broadcast and p2p its ranks sit on the GPUs after the trainer's")
    bench.add_argument("--bucket-mb", type=_mb, default=None,
                       help="bucket size in MiB (default 0.25 for --soak, 512 for --transport)")
    bench.add_argument("--check-every", type=int, default=100, help="compare the engine's logits every N updates")
    bench.add_argument("--sample-every", type=int, default=10, help="sample resources every N updates")
    bench.add_argument("--json", default=None, help="also write the report (with every sample) here")
    _quantize_args(bench)


def _add_engine(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream engine``: the reference engine as an HTTP server."""
    engine = sub.add_parser(
        "engine",
        help="run the reference engine: an HTTP server speaking SGLang's weight-update protocol",
        description=(
            "Starts N worker processes (engine TP N), each holding its shard of a transformers model, and serves "
            "SGLang's weight-update protocol (init group, update from distributed / tensor, destroy, pause/continue, "
            "begin/end) plus /generate and /weightstream/logits. Binds to loopback by default."
        ),
    )
    engine.add_argument("--model", required=True, help="HF model directory (config.json; weights optional)")
    engine.add_argument("--tp", type=int, default=1, help="engine tensor-parallel size (default 1)")
    engine.add_argument("--ep", type=int, default=1,
                        help="expert parallelism over the TP ranks: 1, or the same as --tp (each rank holds its "
                             "routed experts whole, as SGLang's --ep-size; default 1)")
    engine.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    engine.add_argument("--port", type=int, default=30000, help="port (default 30000; 0 picks a free one)")
    key = engine.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=os.environ.get("WEIGHTSTREAM_API_KEY"),
                     help="require 'Authorization: Bearer KEY' (default: $WEIGHTSTREAM_API_KEY, else none; a key "
                          "on the command line shows in ps: prefer the variable or --api-key-file)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="read the key from this file (its first line)")
    engine.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                        help="most tokens one /generate or /weightstream/logits request may ask for, summed over "
                             "its rows, new tokens included (default 16384)")
    engine.add_argument("--device", default=None,
                        help="cpu, cuda (rank r on GPU r), or one device per rank: cuda:2,cuda:3 "
                             "(default: cuda when available)")
    engine.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights dtype (default float32)")
    engine.add_argument("--no-rollback", action="store_true",
                        help="keep no copy of the weights during an update (saves one model's memory and one copy "
                             "per update, as SGLang keeps none); an aborted update then leaves the engine refusing "
                             "to serve until a complete update")
    engine.add_argument("--refuse-nonfinite", action="store_true",
                        help="refuse a bucket holding a weight with NaN or an infinity (by default it is loaded, and "
                             "named in the update's answer and on stderr); block-FP8 scales that are not finite and "
                             "positive are refused either way")


def _add_convert(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream convert``: a Megatron-Core checkpoint on disk to an HF checkpoint."""
    convert = sub.add_parser(
        "convert",
        help="convert a Megatron-Core checkpoint on disk (torch_dist or legacy per-rank) to an HF checkpoint",
        description=(
            "Read a Megatron-Core checkpoint (distributed torch_dist format, or the legacy mp_rank_XX[_YYY][_ZZZ] "
            "files), saved under any TP/PP/VPP/EP layout, tensor by tensor in this one process, and write the HF "
            "safetensors checkpoint that from_pretrained opens."
        ),
    )
    convert.add_argument("checkpoint", help="the save directory (latest_checkpointed_iteration.txt, iter_*/) "
                         "or one iteration's directory")
    convert.add_argument("--hf-config", required=True, metavar="DIR|PRESET",
                         help="the model's HF config: a directory with config.json, or a preset name")
    convert.add_argument("--out", required=True,
                         help="output directory: written beside it and moved into place when complete; must be "
                              "empty or absent unless --overwrite")
    _quantize_args(convert)
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a non-empty --out (whole, in one step, once the new checkpoint is complete)")
    convert.add_argument("--iteration", default=None, help="which iteration (default: the latest the tracker names)")
    convert.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                         help="cast floating tensors (default: as stored)")
    convert.add_argument("--bucket-mb", type=_mb, default=_mb("256"), help="bucket size in MiB (default 256)")
    convert.add_argument("--shard-mb", type=_mb, default=_mb("4096"),
                         help="safetensors file size in MiB (default 4096)")
    convert.add_argument("--procs", type=int, default=1,
                         help="local processes sharing the work, each writing its own safetensors files (default 1)")
    convert.add_argument("--verify", default=None, metavar="HF_DIR",
                         help="compare the result with this HF checkpoint, bit for bit (the end-to-end check: "
                              "tensor data is checked against the CRC-32s its files record, the rest is not)")
    convert.add_argument("--trust-checkpoint", action="store_true",
                         help="read only checkpoints you trust: checkpoints are pickles, and by default a file "
                              "naming a global that Megatron does not save there is refused; --trust-checkpoint "
                              "reads it anyway and allows arbitrary code in it to run")


def _add_verify(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream verify``: two HF checkpoints compared tensor by tensor."""
    verify = sub.add_parser(
        "verify",
        help="compare two HF checkpoints tensor by tensor",
        description="Lists every missing, extra, mis-shaped, mis-typed and differing tensor; exit status 1 on any, "
                    "2 when a checkpoint cannot be read (a missing, truncated or damaged file).",
    )
    verify.add_argument("a", help="first checkpoint directory")
    verify.add_argument("b", help="second checkpoint directory")
    verify.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bit for bit)")


def _add_families(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream families``: the registered model families and what each declares."""
    sub.add_parser(
        "families",
        help="list the model families weightstream converts (HF model_type) and what each declares",
        description="One line per registered converter: its HF model_type; dense or MoE (routed experts declared "
                    "over the expert-TP group); whether it declares a block-FP8 layout (Converter.fp8); how "
                    "transformers holds it in memory where that differs from the checkpoint's names; and the "
                    "presets of that model_type.",
    )


# The sub-commands, in the order ``weightstream --help`` lists them.
_COMMANDS: tuple[Callable[[_Subparsers, list[str]], None], ...] = (
    _add_demo, _add_dump, _add_bench, _add_engine, _add_convert, _add_verify, _add_families,
)


def _check_world(tp: int, pp: int) -> int:
    world = tp * pp
    if world < 1 or tp < 1 or pp < 1:
        raise SystemExit("error: --tp and --pp must be positive")
    return world


def _layout(args: argparse.Namespace, cfg):
    """The layout the options ask for, checked against the model: every problem in one error."""
    from weightstream.converters.registry import model_spec
    from weightstream.jobs import Layout

    _check_world(args.tp, args.pp)
    layout = Layout(args.tp, args.pp, args.vpp, args.ep, args.etp)
    problems = []
    if args.ep < 1 or (args.etp is not None and args.etp < 1):
        problems.append("--ep and --etp must be positive")
    spec = model_spec(cfg)
    if not spec.is_moe and (args.ep > 1 or args.etp is not None):
        problems.append(f"--ep / --etp need a mixture-of-experts model; {spec.model_type} has no experts")
    if spec.is_moe and args.ep >= 1 and spec.num_experts % args.ep:
        problems.append(f"{spec.num_experts} experts cannot be split over --ep {args.ep}")
    if problems:
        raise SystemExit("error: " + "; ".join(problems))
    return layout


def _output_problem(out: Path, overwrite: bool) -> str | None:
    """Why no checkpoint may be written at ``out`` (:func:`weightstream.common.staging.check_target`), found before any
    work starts; None when it may."""
    from weightstream.common.staging import check_target
    from weightstream.errors import WeightstreamError

    try:
        check_target(out, overwrite=overwrite)
    except WeightstreamError as exc:
        return str(exc)
    return None


def cmd_dump(args: argparse.Namespace) -> int:
    from weightstream.common.staging import clean_leftovers
    from weightstream.jobs import dump_job
    from weightstream.launch import LaunchError, launch
    from weightstream.models.presets import preset_config, save_random_checkpoint

    out = Path(os.path.realpath(args.out))
    problem = _output_problem(out, args.overwrite)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="weightstream-src-") as tmp:
        if args.preset:
            layout = _layout(args, preset_config(args.preset))
            hf_dir = save_random_checkpoint(preset_config(args.preset), tmp, seed=args.seed, dtype=_dtype(args.dtype))
        else:
            hf_dir = args.hf
            if not Path(hf_dir, "config.json").exists():
                raise SystemExit(f"error: {hf_dir} has no config.json")
            layout = _layout(args, hf_dir)
        world = layout.world_size
        print(f"dumping {args.preset or hf_dir} under {layout.describe()} to {args.out}", file=sys.stderr)
        try:
            results = launch(world, dump_job, hf_dir, layout, args.out, args.bucket_mb, args.dtype, None, args.writers,
                             None, args.overwrite, None, _quantize(args))
        except LaunchError as exc:
            clean_leftovers(out)  # what a rank killed mid-write left beside --out
            if not exc.reasons:
                raise
            print(f"error: {exc.reasons[min(exc.reasons)]}", file=sys.stderr)
            return 2
    r = results[0]
    print(_summary(r))
    return 0


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _summary(r: dict) -> str:
    gbps = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] > 0 else float("inf")
    return (
        f"{r['tensors']} tensors, {r['bytes'] / 1e6:.2f} MB, {r['buckets']} buckets, {r['files']} files, "
        f"{r['seconds']:.2f} s, {gbps:.3f} GB/s"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """``weightstream demo``: a random checkpoint through a local Megatron job into an engine and to disk, proven."""
    from weightstream.launch import start_process_server

    start_process_server()  # the engine's and the job's processes come from it: its imports overlap ours
    import secrets

    from weightstream.models.presets import preset_config
    from weightstream.reference_engine.server import stop

    cfg = preset_config(args.preset)
    layout = _layout(args, cfg)
    problem = None if args.out is None else _output_problem(Path(os.path.realpath(args.out)), args.overwrite)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    key = secrets.token_urlsafe(16)  # the demo's engine takes updates from the demo only
    with tempfile.TemporaryDirectory(prefix="weightstream-demo-") as tmp:
        src = _demo_source(cfg, args.preset, args.seed, tmp)
        out = args.out or os.path.join(tmp, "streamed")
        server = _demo_engine(src, args.engine_tp, key, tmp)
        try:
            results, engine_logits = _demo_stream(args, layout, src, out, server, key)
        finally:
            if server is not None:
                stop(server)
        r = results[0]
        if r["update"] is not None:
            print(f"      engine update: {r['update'].summary()}")
        same_tensors = _demo_compare(src, out)
        same_logits = _demo_logits(results, engine_logits, out, layout)
    proven = same_tensors and same_logits
    verdict = "PROVEN" if proven else "FAILED"
    print(f"{verdict}: {_summary(r)} (total {time.perf_counter() - start:.1f} s)")
    return 0 if proven else 1


def _demo_source(cfg: Any, preset: str, seed: int, tmp: str) -> str:
    """Step 1: the random HF checkpoint the demo streams, written under ``tmp``; its directory."""
    from weightstream.models.presets import random_hf_model

    src = os.path.join(tmp, "source")
    model = random_hf_model(cfg, seed=seed)
    model.save_pretrained(src)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[1/5] {preset}: random HF checkpoint written ({n_params:,} parameters)")
    return src


def _demo_engine(src: str, engine_tp: int, key: str, tmp: str) -> EngineServer | None:
    """Step 2: a reference engine of TP ``engine_tp`` on the source's config without its weights (None at TP 0)."""
    import shutil

    from weightstream.reference_engine.server import serve

    if engine_tp <= 0:
        print("[2/5] no engine (--engine-tp 0)")
        return None
    empty = os.path.join(tmp, "engine-model")
    os.makedirs(empty)
    shutil.copy(os.path.join(src, "config.json"), empty)  # the engine starts without these weights
    server = serve(empty, engine_tp, api_key=key)
    print(f"[2/5] reference engine (TP {engine_tp}) serving on {server.url}, weights not loaded yet")
    return server


def _demo_stream(args: argparse.Namespace, layout: Layout, src: str, out: str, server: EngineServer | None,
                 key: str) -> tuple[list[dict[str, Any]], torch.Tensor | None]:
    """Step 3: the local job loads ``src`` into Megatron, updates the engine and writes ``out``; every rank's
    result, and the engine's logits after the update (None without an engine)."""
    from weightstream.engines import ReferenceEngine
    from weightstream.jobs import dump_job
    from weightstream.launch import launch

    print(f"[3/5] starting {layout.world_size} local processes ({layout.describe()}): build Megatron-Core model, "
          f"load, {'update the engine, ' if server else ''}stream to disk")
    results = launch(layout.world_size, dump_job, src, layout, out, args.bucket_mb, "float32", DEMO_INPUT, "rank0",
                     server.url if server else None, args.overwrite, key)
    engine_logits = ReferenceEngine(server.url, api_key=key).logits(DEMO_INPUT) if server else None
    return results, engine_logits


def _demo_compare(src: str, out: str) -> bool:
    """Step 4: every tensor of the written checkpoint against the source, bit for bit; whether all are equal."""
    from weightstream.testing.compare import compare_checkpoints

    print("[4/5] checking every tensor of the checkpoint against the source, bit for bit")
    cmp = compare_checkpoints(src, out)
    print("      " + cmp.render("source", "streamed").replace("\n", "\n      "))
    return cmp.ok


def _demo_logits(results: list[dict[str, Any]], engine_logits: torch.Tensor | None, out: str, layout: Layout) -> bool:
    """Step 5: the logits of every Megatron rank and of the engine against those of the HF model loaded from
    ``out``; whether all are equal (within 1e-4)."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = loaded(torch.tensor(DEMO_INPUT)).logits.float()
    diffs = [(res["logits"] - hf_logits).abs().max().item() for res in results]
    checks = [max(diffs) <= 1e-4]
    line = f"Megatron ({layout.describe()}) vs HF from the checkpoint: max |diff| {max(diffs):.2e}"
    if engine_logits is not None:
        engine_diff = (engine_logits - hf_logits).abs().max().item()
        checks.append(engine_diff <= 1e-4)
        line += f"; engine vs HF: {engine_diff:.2e}"
    print(f"[5/5] logits: {line}")
    return all(checks)


def cmd_convert(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from weightstream.convert import convert_checkpoint
    from weightstream.errors import WeightstreamError

    hf_config: Any = args.hf_config
    if not Path(hf_config).is_dir():
        from weightstream.models.presets import PRESETS, preset_config

        if hf_config not in PRESETS:
            raise SystemExit(f"error: --hf-config {hf_config!r} is neither a directory nor a preset "
                             f"(presets: {', '.join(sorted(PRESETS))})")
        hf_config = preset_config(hf_config)
    elif not Path(hf_config, "config.json").exists():
        raise SystemExit(f"error: {hf_config} has no config.json")
    bar = tqdm(desc="converting", unit="bucket", leave=False, disable=None)  # drawn on a terminal only

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        report = convert_checkpoint(args.checkpoint, hf_config, args.out, iteration=args.iteration,
                                    dtype=_dtype(args.dtype) if args.dtype else None, bucket_bytes=args.bucket_mb,
                                    shard_bytes=args.shard_mb, progress=progress, verify=args.verify,
                                    procs=args.procs, overwrite=args.overwrite,
                                    trust_checkpoint=args.trust_checkpoint, quantize=_quantize(args))
    except WeightstreamError as exc:
        bar.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    if report.verify is not None:
        print(report.verify.render(args.verify, args.out))
    print(report.summary())
    return 0 if report.verify is None or report.verify.ok else 1


def cmd_verify(args: argparse.Namespace) -> int:
    from weightstream.errors import WeightstreamError
    from weightstream.testing.compare import compare_checkpoints

    for d in (args.a, args.b):
        if not Path(d).is_dir():
            print(f"error: {d} is not a directory", file=sys.stderr)
            return 2
    try:
        cmp = compare_checkpoints(args.a, args.b, atol=args.atol)
    except WeightstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(cmp.render(args.a, args.b))
    return 0 if cmp.ok else 1


def engine_api_key(args: argparse.Namespace) -> str | None:
    """The engine's key: from --api-key-file, else --api-key, else $WEIGHTSTREAM_API_KEY, else none."""
    if args.api_key_file is None:
        return args.api_key or None
    with open(args.api_key_file) as f:
        key = f.readline().strip()
    if not key:
        raise SystemExit(f"error: --api-key-file {args.api_key_file} is empty")
    return key


def _engine_model_problem(model_dir: str) -> str | None:
    """What stops an engine from starting on ``model_dir`` (no config, an unreadable config or weight file),
    found before any worker starts; None when there is nothing (a directory without weights is fine)."""
    from weightstream.common.hf_files import CheckpointReader, NoWeightsError
    from weightstream.errors import WeightstreamError
    from weightstream.models.spec import load_hf_config

    if not Path(model_dir, "config.json").is_file():
        return f"{model_dir} has no config.json"
    try:
        load_hf_config(model_dir)
        CheckpointReader(model_dir).close()
    except NoWeightsError:
        return None
    except WeightstreamError as exc:
        return str(exc)
    except (OSError, ValueError) as exc:
        return f"{model_dir}: {exc}"
    return None


def _engine_experts(model_dir: str) -> int:
    """The routed experts the engine's model declares (0: dense), from its config.json (read by then)."""
    import json

    from weightstream.reference_engine.schema import routed_experts

    with open(Path(model_dir, "config.json")) as f:
        return routed_experts(json.load(f))


def cmd_engine(args: argparse.Namespace) -> int:
    import signal
    import threading

    from weightstream.reference_engine.schema import ep_problem
    from weightstream.reference_engine.server import ServerLimits, serve, stop
    from weightstream.reference_engine.values import LoadChecks

    problem = _engine_model_problem(args.model) or ep_problem(args.ep, args.tp, _engine_experts(args.model))
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    api_key = engine_api_key(args)
    limits = ServerLimits() if args.max_batch_tokens is None else ServerLimits(max_batch_tokens=args.max_batch_tokens)
    done = threading.Event()
    got: list[int] = []

    def on_signal(signum, frame) -> None:
        got.append(signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = serve(args.model, args.tp, args.host, args.port, api_key, args.device, args.dtype,
                   rollback=not args.no_rollback, limits=limits, ep=args.ep,
                   checks=LoadChecks(refuse_nonfinite=args.refuse_nonfinite))
    ep = f" EP {args.ep}" if args.ep > 1 else ""
    print(f"weightstream engine: {args.model} (TP {args.tp}{ep}) serving on {server.url}", flush=True)
    code = 0
    while not done.wait(0.2):
        if not server.engine.alive():
            print("an engine rank died; stopping", file=sys.stderr)
            code = 1
            break
    if got:
        print(f"weightstream engine: {signal.Signals(got[0]).name}: stopping (an update in flight is not committed)",
              file=sys.stderr, flush=True)
    stop(server)
    return code


def _bench_delta(args: argparse.Namespace) -> int:
    """``bench --delta --transport T``: one row per transport (``weightstream.bench.delta``)."""
    from weightstream.bench.delta import run_delta_bench, write_delta_json

    results = []
    for transport in args.transport:
        res = run_delta_bench(args.preset, transport, tiny=args.tiny, dtype=args.dtype,
                              bucket_bytes=args.bucket_mb or (512 << 20), lrs=args.lr, steps=args.steps,
                              repeats=args.repeats, masters=args.masters, snapshot=args.snapshot, tp=args.tp)
        print(res.render(), flush=True)
        results.append(res)
    if args.json:
        write_delta_json(results, args.json)
    return _rows_status([f"{r.preset} {r.transport}" for r in results if r.failed])


def _rows_status(failed: list[str]) -> int:
    """The exit status of a run of benchmark rows: 1, said on stderr, where the check of any (``failed``) did not
    pass."""
    if failed:
        print(f"FAILED: the check of {len(failed)} row(s) did not pass: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    if args.from_json:
        from weightstream.bench.speed import BenchResult, plot

        rows = []
        for path in args.from_json:
            with open(path) as f:
                rows += [BenchResult.from_dict(d) for d in json.load(f)]
        for row in rows:
            print(row.render(), flush=True)
        if args.plot:
            print(plot(rows, args.plot))
        return 1 if any(row.failed for row in rows) else 0
    if args.transport and args.delta:
        return _bench_delta(args)
    if args.transport:
        from weightstream.bench.speed import plot, run_bench, write_json

        results = []
        for transport in args.transport:
            res = run_bench(args.preset, transport, tiny=args.tiny, dtype=args.dtype,
                            bucket_bytes=args.bucket_mb or (512 << 20), repeats=args.repeats,
                            reuse_buffers=args.reuse_buffers, rollback=not args.no_rollback,
                            ahead=not args.per_bucket, tp=args.tp, engine_tp=args.engine_tp, ep=args.ep,
                            prepare=args.prepare, direct=not args.no_direct, quantize=_quantize(args),
                            replicas=args.replicas)
            print(res.render(), flush=True)
            results.append(res)
        if args.json:
            write_json(results, args.json)
        if args.plot:
            print(plot(results, args.plot))
        return _rows_status([f"{r.preset} {r.transport}" for r in results if r.failed])

    from weightstream.bench.soak import run_soak

    transports = tuple(t.strip() for t in args.transports.split(",") if t.strip())
    unknown = [t for t in transports if t not in ("broadcast", "ipc", "p2p")]
    if unknown or not transports:
        print(f"unknown transports {unknown}; choose among broadcast, ipc, p2p", file=sys.stderr)
        return 2
    report = run_soak(args.soak, transports=transports, switch_every=args.switch_every, preset=args.preset,
                      engine_tp=args.engine_tp or 1, bucket_bytes=args.bucket_mb or _mb("0.25"),
                      check_every=args.check_every, sample_every=args.sample_every, progress=sys.stderr.isatty())
    print(report.render())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return 0 if report.ok else 1


def cmd_families(args: argparse.Namespace) -> int:
    from weightstream.converters.registry import get_converter, known_model_types
    from weightstream.models.presets import PRESETS

    rows = [("model_type", "kind", "block FP8", "in memory", "presets")]
    for model_type in known_model_types():
        conv = get_converter(model_type)
        moe = any(m.tp_group == "etp" for m in conv.mappings)
        fp8 = f"declared ({len(conv.fp8)} weight patterns)" if conv.fp8 else "not declared"
        memory = f"{len(conv.memory)} declarations (fused experts)" if conv.memory else "as saved"
        presets = ", ".join(sorted(n for n, p in PRESETS.items() if p["model_type"] == model_type)) or "-"
        rows.append((model_type, "MoE" if moe else "dense", fp8, memory, presets))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[4])
    print(f"{len(rows) - 1} families; add one with weightstream.register_converter (README: Registering a new model)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from weightstream.common.quiet import quiet_command

    args = build_parser().parse_args(argv)
    quiet_command(args.verbose)
    handler = {"demo": cmd_demo, "dump": cmd_dump, "verify": cmd_verify, "engine": cmd_engine,
               "bench": cmd_bench, "convert": cmd_convert, "families": cmd_families}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
