"""The ``weightstream`` command.

Nothing heavy is imported before the command line is parsed (torch, transformers and Megatron-Core load in the
command that needs them), so that ``--help`` and ``presets`` answer at once. One vocabulary across the
commands: ``--hf DIR`` is the HF directory, ``--preset NAME`` a named config (``weightstream presets``),
``--dtype`` the dtype of the weights written or served and ``--megatron-dtype`` that of the Megatron model's
parameters; a list option takes comma-separated values and may be repeated. Every user error is one
``error: ...`` line on stderr and exit status 2 (its traceback under ``-v``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

if TYPE_CHECKING:
    import torch

    from weightstream.common.progress import Progress
    from weightstream.models.parallel import Layout
    from weightstream.models.spec import ModelSpec
    from weightstream.reference_engine.server import EngineServer
    from weightstream.wire.fp8 import BlockFP8

__all__ = [
    "DEMO_INPUT", "DTYPES", "BUCKET_MB", "TINY_BUCKET_MB", "UsageError", "build_parser", "BENCH_TRANSPORTS",
    "SOAK_TRANSPORTS", "cmd_example", "layout_problems", "engine_tp_problem", "cmd_dump", "JobFailure", "cmd_demo",
    "cmd_convert", "cmd_verify", "engine_api_key", "cmd_engine", "cmd_bench", "cmd_families", "preset_size",
    "cmd_presets", "main"
]


DEMO_INPUT = [[1, 17, 42, 256, 999, 3, 511, 64, 128, 7, 900, 12]]
DTYPES = ("float32", "bfloat16", "float16")
# One bucket size for every command that moves a real model; the demo and the soak take a tiny one (see theirs).
BUCKET_MB = "512"
TINY_BUCKET_MB = "0.25"

_Subparsers: TypeAlias = "argparse._SubParsersAction[_Parser]"


class UsageError(Exception):
    """A user error the command reports as one ``error:`` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad command line reported as one ``error:`` line (the usage is a ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions wrapped to the terminal as argparse does; an indented block (an example) kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = text.split("\n\n")
        return "\n\n".join(b if b.startswith(" ") or "\n " in b else argparse.HelpFormatter._fill_text(
            self, b, width, indent) for b in blocks)


class _Deprecated(argparse.Action):
    """A former spelling of an option, left out of ``--help``: stored as the new spelling stores it, after a
    one-line note on stderr."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, instead: str, **kwargs: Any):
        self.instead = instead
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"note: {option_string} is deprecated; use {self.instead}", file=sys.stderr)
        setattr(namespace, self.dest, values)


class _List(argparse.Action):
    """A list option: each use takes comma-separated values (its ``type`` splits them), and uses add up; the
    first use replaces the default."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, tuple(values) if current is self.default else (*current, *values))


def _mb(value: str) -> int:
    try:
        mb = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of MiB: {value!r}") from None
    if mb <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
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


def _seconds(value: str) -> float:
    """A positive, finite number of seconds."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {value}")
    return seconds


def _names(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """The type of a list option of names among ``choices``, comma-separated."""

    def parse(value: str) -> tuple[str, ...]:
        out = tuple(v.strip() for v in value.split(",") if v.strip())
        unknown = [v for v in out if v not in choices]
        if unknown or not out:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, unknown)) or 'nothing'} given; choose among "
                                             f"{', '.join(choices)} (comma-separated)")
        return out

    return parse


def _preset(name: str) -> str:
    """A preset's name, checked against the table (``weightstream presets``) without importing torch."""
    from weightstream.models.presets import PRESETS

    if name not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {name!r} (`weightstream presets` lists them)")
    return name


def _whole(value: str, least: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
    return n


def _positive(value: str) -> int:
    return _whole(value, 1)


def _count(value: str) -> int:
    return _whole(value, 0)


def _command(sub: _Subparsers, name: str, *, help: str, description: str, example: str) -> argparse.ArgumentParser:
    """A sub-command whose ``--help`` ends with ``example`` (lines of shell, shown as written); ``-v`` is taken
    after the sub-command too."""
    parser = sub.add_parser(name, help=help, description=description, formatter_class=_Formatter,
                            epilog="example:\n" + "\n".join(f"  {line}" for line in example.strip().splitlines()))
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="as `weightstream -v`: third-party warnings and bars, and tracebacks of errors")
    return parser


def _preset_arg(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, default: str | None,
                what: str) -> None:
    p.add_argument("--preset", type=_preset, default=default, metavar="NAME",
                   help=f"{what} (see `weightstream presets`" + (f"; default {default})" if default else ")"))


def _layout_args(p: argparse.ArgumentParser, tp: int, pp: int) -> None:
    p.add_argument("--tp", type=_positive, default=tp,
                   help=f"tensor-parallel size of the Megatron model (default {tp})")
    p.add_argument("--pp", type=_positive, default=pp, help=f"pipeline-parallel size (default {pp})")
    p.add_argument("--vpp", type=_positive, default=None, help="virtual pipeline stages per rank (default: none)")
    p.add_argument("--ep", type=_positive, default=1,
                   help="expert-parallel size, for mixture-of-experts models (default 1)")
    p.add_argument("--etp", type=_positive, default=None,
                   help="expert tensor-parallel size, for mixture-of-experts models (default: the same as --tp)")


def _megatron_dtype_arg(p: argparse.ArgumentParser, default: str, what: str) -> None:
    """``--megatron-dtype``: the Megatron model's parameter dtype (``--dtype`` its former spelling)."""
    p.add_argument("--megatron-dtype", default=default, choices=DTYPES, help=f"{what} (default {default})")
    p.add_argument("--dtype", dest="megatron_dtype", action=_Deprecated, instead="--megatron-dtype", choices=DTYPES)


def _plugin_arg(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--plugin", action="append", default=default, metavar="MODULE",
                        help="import MODULE before the command runs (and in the processes it starts): a module whose "
                             "import registers converters; repeatable or comma-separated (the weightstream.converters "
                             "entry points of installed packages are loaded too)")


def build_parser() -> argparse.ArgumentParser:
    """The ``weightstream`` command line: its global options and the sub-commands of :data:`_COMMANDS`."""
    from weightstream._version import __version__
    from weightstream.models.presets import PRESETS

    parser = _Parser(
        prog="weightstream",
        description="Stream Megatron-Core weights in the Hugging Face layout: to disk, or into inference engines. "
                    "`weightstream families` lists the model types it converts, `weightstream presets` the named "
                    "configs.",
        formatter_class=_Formatter,
        epilog="example:\n  weightstream demo\n  weightstream dump --preset tiny-qwen3 --tp 2 --pp 2 --out /tmp/tiny",
    )
    parser.add_argument("--version", action="version", version=f"weightstream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also show third-party warnings and progress bars (Megatron-Core, torch, transformers), "
                             "and the traceback of an error")
    _plugin_arg(parser, [])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    presets = sorted(PRESETS)
    for add_command in _COMMANDS:
        add_command(sub, presets)
    for command in sub.choices.values():  # --plugin before or after the command
        _plugin_arg(command, argparse.SUPPRESS)
    return parser


def _add_demo(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream demo``: the whole path on a tiny model, proven."""
    demo = _command(
        sub, "demo",
        help="build a tiny Qwen3, stream it from a local TP×PP job into a reference engine and to disk, prove both",
        description=(
            "Builds a tiny Qwen3 model with random weights, starts a reference engine (TP 2) that does not hold "
            "them, starts local CPU processes (TP 2 × PP 2 by default), loads the weights into a Megatron-Core "
            "model, updates the engine with update_weights (P2P here: engine TP equals trainer TP), writes an HF "
            "checkpoint, and proves it all: every tensor of the checkpoint bit-identical to the source, and the "
            "logits of the Megatron model, of the HF model loaded from the checkpoint and of the engine equal. "
            "Exit status 0 only when proven."
        ),
        example="weightstream demo\nweightstream demo --preset tiny-qwen3-moe --tp 1 --pp 2 --ep 2 --engine-tp 0",
    )
    _preset_arg(demo, "tiny-qwen3", "model")
    _layout_args(demo, 2, 2)
    demo.add_argument("--bucket-mb", type=_mb, default=_mb(TINY_BUCKET_MB),
                      help=f"bucket size in MiB (default {TINY_BUCKET_MB}, not the {BUCKET_MB} of the other "
                           "commands: the tiny model is about 1 MB, and small buckets make it cross several, as a "
                           "real model does)")
    demo.add_argument("--out", default=None, help="keep the checkpoint here (default: a temporary directory)")
    demo.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    demo.add_argument("--engine-tp", type=_count, default=2,
                      help="TP size of the reference engine the demo updates (default 2; 0: no engine, disk only)")


def _add_dump(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream dump``: HF weights into a Megatron model under a layout, streamed to an HF checkpoint."""
    dump = _command(
        sub, "dump",
        help="build a Megatron model under a layout from HF weights, stream it, write an HF checkpoint",
        description=(
            "Builds the Megatron-Core model for an HF checkpoint (or a preset with random weights) under the "
            "given parallel layout on local CPU processes, loads the weights, streams them and writes an HF "
            "safetensors checkpoint (shards, index, config.json). Progress goes to stderr: a bar on a terminal, "
            "plain lines otherwise."
        ),
        example="weightstream dump --preset tiny-qwen3 --tp 2 --pp 2 --out /tmp/tiny-qwen3\n"
                "weightstream dump --hf ./Qwen3-0.6B --tp 2 --megatron-dtype bfloat16 --out ./streamed",
    )
    src = dump.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="DIR", help="HF checkpoint directory to start from")
    _preset_arg(src, None, "a preset config with random weights")
    dump.add_argument("--seed", type=int, default=0, help="seed of the random weights for --preset (default 0)")
    _layout_args(dump, 1, 1)
    dump.add_argument("--bucket-mb", type=_mb, default=_mb(BUCKET_MB), help=f"bucket size in MiB (default {BUCKET_MB})")
    _megatron_dtype_arg(dump, "float32", "the Megatron model's parameter dtype, which the checkpoint is written in")
    dump.add_argument("--writers", default="rank0", choices=["rank0", "spread"],
                      help="who writes the files: global rank 0, or spread over all ranks (default rank0)")
    dump.add_argument("--out", required=True, metavar="DIR",
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
    from weightstream.wire.fp8 import BlockFP8

    return BlockFP8(args.fp8_block, args.fp8_scales) if args.quantize == "fp8-block" else None


BENCH_TRANSPORTS = ("stream", "broadcast", "ipc", "p2p", "checkpoint")
SOAK_TRANSPORTS = ("broadcast", "ipc", "p2p")


def _add_bench(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream bench``: its three modes (--transport, --soak, --from-json) and their options."""
    bench = _command(
        sub, "bench",
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
            "service on this machine, alternating two sets of weights and switching between the --transport list "
            "(default broadcast,ipc) every --switch-every updates, checksums on; the engine's logits are compared "
            "with the HF model's every --check-every updates, and the trainer's and engine's memory, file "
            "descriptors, threads and /dev/shm entries are sampled. Prints one report; exit status 0 only when "
            "every update and check passed (leak thresholds are the caller's to judge, from the report or --json). "
            "Progress goes to stderr: a bar on a terminal, plain lines otherwise."
        ),
        example="weightstream bench --transport stream,checkpoint --preset qwen3-8b --tiny\n"
                "weightstream bench --soak 200 --transport broadcast,ipc --json soak.json",
    )
    what = bench.add_mutually_exclusive_group()
    what.add_argument("--soak", type=_positive, metavar="N", help="number of updates")
    what.add_argument("--from-json", nargs="+", metavar="F.json",
                      help="no run: print (and with --plot, chart) the rows saved by earlier --json runs")
    bench.add_argument("--transport", type=_names(BENCH_TRANSPORTS), action=_List, default=None,
                       metavar="T[,T...]",
                       help="the paths to time, comma-separated or repeated (stream, broadcast, ipc, p2p, "
                            "checkpoint); with --soak, the transports to rotate through (broadcast, ipc, p2p; default "
                            "broadcast,ipc)")
    bench.add_argument("--transports", dest="transport", type=_names(SOAK_TRANSPORTS), action=_Deprecated,
                       instead="--transport")
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
    bench.add_argument("--lr", type=_floats, action=_List, default=(1e-6, 1e-5), metavar="LR[,LR...]",
                       help="learning rates of --delta, comma-separated or repeated (default 1e-6,1e-5)")
    bench.add_argument("--steps", type=_positive, default=3,
                       help="optimizer steps per learning rate of --delta (default 3)")
    bench.add_argument("--masters", choices=["device", "host"], default="device",
                       help="where --delta keeps the fp32 master weights and Adam's state (default device)")
    bench.add_argument("--snapshot", choices=["device", "host"], default="device",
                       help="where the sender keeps the bytes it computes deltas against (default device)")
    bench.add_argument("--optimizer-on-host", action="store_true",
                       help="--delta: Adam's states in host memory, each parameter stepped on the device in turn "
                            "(the device holds one parameter's states at a time; with --masters host, its masters too)")
    bench.add_argument("--wire", choices=["default", "socket"], default="default",
                       help="--transport broadcast/p2p on GPUs: socket puts every process of the row on NCCL's "
                            "socket transport over loopback (a link like one between nodes), its ceiling that link's")
    bench.add_argument("--replicas", type=_positive, default=1,
                       help="engines updated at once, each of --engine-tp ranks: by broadcast, through one group with "
                            "every engine rank from one trainer; by p2p, from a trainer of as many data-parallel "
                            "replicas, engine j's buckets sent by replica j (default 1)")
    bench.add_argument("--megatron-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                       help="the Megatron model's parameter dtype, which the engine holds too (default bfloat16)")
    bench.add_argument("--dtype", dest="megatron_dtype", action=_Deprecated, instead="--megatron-dtype",
                       choices=["float32", "bfloat16"])
    bench.add_argument("--repeats", type=_positive, default=3, help="warm runs after the cold one (default 3)")
    bench.add_argument("--plot", default=None, metavar="F.png",
                       help="bar chart of ours vs ceiling (needs matplotlib, checked before any run)")


def _bench_run_args(bench: argparse.ArgumentParser, presets: list[str]) -> None:
    """The options of ``bench --soak``, those of the model, trainer and engine that both runs share, and --json."""
    bench.add_argument("--switch-every", type=_positive, default=2,
                       help="--soak: updates per transport before switching (default 2)")
    _preset_arg(bench, "tiny-qwen3", "model")
    bench.add_argument("--tp", type=_positive, default=1,
                       help="--transport broadcast/ipc/p2p: the trainer's TP size, one GPU per rank (default 1)")
    bench.add_argument("--ep", type=_positive, default=1,
                       help="--transport broadcast/ipc/p2p: the trainer's expert-parallel size (MoE presets; the "
                            "trainer then has TP x EP ranks; default 1)")
    bench.add_argument("--engine-tp", type=_positive, default=None,
                       help="TP size of the reference engine (default: --soak 1, --transport the trainer's TP); with "
                            "broadcast and p2p its ranks sit on the GPUs after the trainer's")
    bench.add_argument("--bucket-mb", type=_mb, default=None, metavar="MB",
                       help=f"bucket size in MiB (default {BUCKET_MB}, as every command's; --soak: {TINY_BUCKET_MB}, "
                            "so that its tiny model crosses several buckets in each update, as a real model does)")
    bench.add_argument("--check-every", type=_positive, default=100,
                       help="--soak: compare the engine's logits every N updates (default 100)")
    bench.add_argument("--sample-every", type=_positive, default=10,
                       help="--soak: sample resources every N updates (default 10)")
    bench.add_argument("--json", default=None, metavar="F.json", help="also write the report (with every sample) here")
    _quantize_args(bench)


def _add_engine(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream engine``: the reference engine as an HTTP server."""
    engine = _command(
        sub, "engine",
        help="run the reference engine: an HTTP server speaking SGLang's weight-update protocol",
        description=(
            "Starts N worker processes (engine TP N), each holding its shard of a transformers model, and serves "
            "SGLang's weight-update protocol (init group, update from distributed / tensor, destroy, pause/continue, "
            "begin/end) plus /generate and /weightstream/logits. Binds to loopback by default. Prints one line "
            "on stdout when it serves (its URL last); progress while the workers start goes to stderr."
        ),
        example="weightstream engine --hf ./Qwen3-0.6B --tp 2 --port 30000",
    )
    model = engine.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf", metavar="DIR", help="HF model directory (config.json; weights optional)")
    model.add_argument("--model", dest="hf", action=_Deprecated, instead="--hf")
    engine.add_argument("--tp", type=_positive, default=1, help="engine tensor-parallel size (default 1)")
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
    engine.add_argument("--max-batch-tokens", type=_positive, default=None, metavar="N",
                        help="most tokens one /generate or /weightstream/logits request may ask for, summed over "
                             "its rows, new tokens included (default 16384)")
    engine.add_argument("--max-request-seconds", type=_seconds, default=None, metavar="S",
                        help="most time the workers spend on one /generate request; past it the request is stopped "
                             "between two decode steps and answered 413 (default 60)")
    engine.add_argument("--device", default=None,
                        help="cpu, cuda (rank r on GPU r), or one device per rank: cuda:2,cuda:3 "
                             "(default: cuda when available)")
    engine.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="dtype the engine holds the weights in (default float32)")
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
    convert = _command(
        sub, "convert",
        help="convert a Megatron-Core checkpoint on disk (torch_dist or legacy per-rank) to an HF checkpoint",
        description=(
            "Read a Megatron-Core checkpoint (distributed torch_dist format, or the legacy mp_rank_XX[_YYY][_ZZZ] "
            "files), saved under any TP/PP/VPP/EP layout, tensor by tensor in this one process, and write the HF "
            "safetensors checkpoint that from_pretrained opens. Progress goes to stderr: a bar on a terminal, "
            "plain lines otherwise. Exit status 0 when written (and, with --verify, equal), 1 when --verify "
            "finds a difference, 2 on a user error."
        ),
        example="weightstream convert /ckpt/run1 --hf /models/Qwen3-8B --out /ckpt/run1-hf --verify /models/Qwen3-8B",
    )
    convert.add_argument("checkpoint", help="the save directory (latest_checkpointed_iteration.txt, iter_*/) "
                         "or one iteration's directory")
    model = convert.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf", metavar="DIR", help="the model's HF directory (its config.json is what is read)")
    _preset_arg(model, None, "the model's config, by preset name")
    model.add_argument("--hf-config", action=_Deprecated, instead="--hf DIR or --preset NAME")
    convert.add_argument("--out", required=True, metavar="DIR",
                         help="output directory: written beside it and moved into place when complete; must be "
                              "empty or absent unless --overwrite")
    _quantize_args(convert)
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a non-empty --out (whole, in one step, once the new checkpoint is complete)")
    convert.add_argument("--iteration", default=None, help="which iteration (default: the latest the tracker names)")
    convert.add_argument("--dtype", default=None, choices=DTYPES,
                         help="dtype of the floating tensors written (default: as stored)")
    convert.add_argument("--bucket-mb", type=_mb, default=_mb(BUCKET_MB),
                         help=f"bucket size in MiB (default {BUCKET_MB})")
    convert.add_argument("--shard-mb", type=_mb, default=_mb("4096"),
                         help="safetensors file size in MiB (default 4096)")
    convert.add_argument("--procs", type=_positive, default=1,
                         help="local processes sharing the work, each writing its own safetensors files (default 1)")
    convert.add_argument("--verify", default=None, metavar="DIR",
                         help="compare the result with this HF checkpoint, bit for bit (the end-to-end check: "
                              "tensor data is checked against the CRC-32s its files record, the rest is not)")
    convert.add_argument("--trust-checkpoint", action="store_true",
                         help="read only checkpoints you trust: checkpoints are pickles, and by default a file "
                              "naming a global that Megatron does not save there is refused; --trust-checkpoint "
                              "reads it anyway and allows arbitrary code in it to run")


def _add_verify(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream verify``: two HF checkpoints compared tensor by tensor."""
    verify = _command(
        sub, "verify",
        help="compare two HF checkpoints tensor by tensor",
        description=(
            "Lists the missing, extra, mis-shaped, mis-typed and differing tensors of two HF checkpoint "
            "directories (the first --limit of each kind, then how many more). The two directories are positional, "
            "as diff takes them: neither is the model's --hf directory of the other commands. With --atol, "
            "tensors of different dtypes are compared as float32 values and the dtypes are a note, not a "
            "difference.\n\n"
            "exit status:\n"
            "  0  the checkpoints are equal (bit for bit, or within --atol)\n"
            "  1  differences found\n"
            "  2  a user error: a directory missing or unreadable (a missing, truncated or damaged file)"
        ),
        example="weightstream verify /models/Qwen3-8B /ckpt/run1-hf\n"
                "weightstream verify /models/Qwen3-8B ./bf16-copy --atol 1e-2",
    )
    verify.add_argument("a", metavar="A", help="first checkpoint directory")
    verify.add_argument("b", metavar="B", help="second checkpoint directory")
    verify.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bit for bit)")
    verify.add_argument("--limit", type=int, default=20, metavar="N",
                        help="tensors listed per kind of difference, then a count of the rest (default 20; 0: all)")


@dataclass(frozen=True)
class _Listing:
    """A command that lists what weightstream knows (``families``, ``presets``): its name and its help."""

    name: str
    help: str
    description: str
    example: str


_LISTINGS = (
    _Listing("families", "list the model families weightstream converts (HF model_type) and what each declares",
             "One line per registered converter: its HF model_type; dense or MoE (routed experts declared over the "
             "expert-TP group); whether it declares a block-FP8 layout (Converter.fp8); how transformers holds it in "
             "memory where that differs from the checkpoint's names; and the presets of that model_type.",
             "weightstream families"),
    _Listing("presets", "list the presets (named model configs) that --preset takes",
             "One line per preset: its name, HF model_type and size (layers, hidden width, attention heads, experts, "
             "vocabulary). Presets named tiny-* are small enough for a CPU; the others have the shapes of released "
             "models, for benchmarks (bench --tiny keeps their topology at small widths).",
             "weightstream presets\nweightstream dump --preset tiny-qwen3 --out /tmp/tiny-qwen3"),
)


def _add_listings(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream families`` and ``weightstream presets``: what weightstream converts, and the named configs."""
    for listing in _LISTINGS:
        _command(sub, listing.name, help=listing.help, description=listing.description, example=listing.example)


def _add_example(sub: _Subparsers, presets: list[str]) -> None:
    """``weightstream example``: a tiny training job to try every command on (:mod:`weightstream.example`)."""
    example = _command(
        sub, "example", help="write a tiny job to try weightstream on: HF directory, Megatron checkpoint, script",
        description="Writes into DIR (absent or empty) a tiny Qwen3's HF directory (weights, tokenizer, "
                    "generation_config.json), the same weights as a Megatron-Core torch_dist checkpoint, and "
                    "train_and_stream.py, a torchrun job that trains a few steps and streams into an engine; "
                    "then prints the commands to try on them.",
        example="weightstream example /tmp/ws-example")
    example.add_argument("dir", metavar="DIR", help="where to write the job (absent or empty)")
    example.add_argument("--tp", type=_positive, default=2, help="TP size the checkpoint is saved at (default 2)")


def cmd_example(args: argparse.Namespace) -> int:
    from weightstream.example import write_example

    print(write_example(args.dir, tp=args.tp).next_steps())
    return 0


# The sub-commands, in the order ``weightstream --help`` lists them.
_COMMANDS: tuple[Callable[[_Subparsers, list[str]], None], ...] = (
    _add_demo, _add_dump, _add_bench, _add_engine, _add_convert, _add_verify, _add_listings,
    _add_example,
)


def layout_problems(spec: ModelSpec, layout: Layout) -> list[str]:
    """Every reason a Megatron-Core model of ``spec`` cannot be built under ``layout`` (Megatron-Core's own rules,
    checked before any process starts); [] when it can."""
    tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.etp or layout.tp
    problems = []
    if spec.num_attention_heads % tp:
        problems.append(f"--tp {tp} does not divide the {spec.num_attention_heads} attention heads")
    kv = spec.num_key_value_heads
    if not spec.is_mla and kv % tp and tp % kv:
        problems.append(f"--tp {tp} neither divides the {kv} key/value heads nor is a multiple of them")
    if (not spec.is_moe or spec.dense_layers) and spec.intermediate_size % tp:
        problems.append(f"--tp {tp} does not divide the MLP width {spec.intermediate_size}")
    if spec.shared_expert_intermediate_size % tp:
        problems.append(f"--tp {tp} does not divide the shared expert's width {spec.shared_expert_intermediate_size}")
    if spec.num_layers % pp:
        problems.append(f"--pp {pp} does not divide the {spec.num_layers} layers")
    elif layout.vpp is not None and pp == 1:
        problems.append("--vpp needs --pp of 2 or more")
    elif layout.vpp is not None and (spec.num_layers // pp) % layout.vpp:
        problems.append(f"--vpp {layout.vpp} does not divide the {spec.num_layers // pp} layers of each stage")
    if not spec.is_moe and (ep > 1 or layout.etp is not None):
        problems.append(f"--ep / --etp need a mixture-of-experts model; {spec.model_type} has no experts")
    if spec.is_moe and spec.num_experts % ep:
        problems.append(f"--ep {ep} does not divide the {spec.num_experts} experts")
    if spec.is_moe and spec.moe_intermediate_size % etp:
        problems.append(f"expert TP {etp} (--etp, else --tp) does not divide the experts' width "
                        f"{spec.moe_intermediate_size}")
    return problems


def engine_tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why the reference engine cannot hold ``spec`` at TP ``tp`` (it splits the heads, the key/value heads
    included, over its ranks); None when it can."""
    if spec.num_attention_heads % tp or spec.num_key_value_heads % tp:
        return (f"engine TP {tp} does not divide the attention heads ({spec.num_attention_heads}) and key/value "
                f"heads ({spec.num_key_value_heads})")
    return None


def _model(hf: str | None, preset: str | None) -> tuple[str | None, Any]:
    """The HF directory (None for a preset) and the config that ``--hf``/``--preset`` name, read and checked:
    a missing directory or config.json, an unreadable config or an unknown model type is a :class:`UsageError`."""
    from weightstream.converters.registry import model_spec
    from weightstream.errors import WeightstreamError
    from weightstream.models.presets import preset_config

    if preset is not None:
        return None, preset_config(preset)
    assert hf is not None  # argparse: one of the two
    if not Path(hf).is_dir():
        raise UsageError(f"--hf {hf}: no such directory")
    if not Path(hf, "config.json").is_file():
        raise UsageError(f"--hf {hf} has no config.json")
    from weightstream.models.spec import load_hf_config

    try:
        cfg = load_hf_config(hf)
        model_spec(cfg)
    except (WeightstreamError, ValueError, OSError) as exc:
        raise UsageError(f"--hf {hf}: {_one_line(exc)}") from exc
    return hf, cfg


def _layout(args: argparse.Namespace, cfg: Any, engine_tp: int = 0) -> Layout:
    """The layout the options ask for, checked against the model (and against a reference engine of TP
    ``engine_tp``; 0: none): every problem in one :class:`UsageError`."""
    from weightstream.converters.registry import model_spec
    from weightstream.models.parallel import Layout

    layout = Layout(args.tp, args.pp, args.vpp, args.ep, args.etp)
    spec = model_spec(cfg)
    problems = layout_problems(spec, layout)
    if engine_tp > 0 and (problem := engine_tp_problem(spec, engine_tp)) is not None:
        problems.append(f"--engine-tp: {problem}")
    if problems:
        raise UsageError(f"{spec.model_type} cannot be laid out as asked: " + "; ".join(problems))
    return layout


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (a multi-line message joined with '; ')."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines) or type(exc).__name__


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
    from weightstream.common.progress import Progress
    from weightstream.common.staging import clean_leftovers
    from weightstream.jobs import dump_job
    from weightstream.models.presets import save_random_checkpoint

    out = Path(os.path.realpath(args.out))
    problem = _output_problem(out, args.overwrite)
    if problem is not None:
        raise UsageError(problem)
    hf_dir, cfg = _model(args.hf, args.preset)  # every user error found before the first progress line
    layout = _layout(args, cfg)
    # The progress closes first: it reads the ranks' last lines from the file in ``tmp`` before ``tmp`` goes.
    with tempfile.TemporaryDirectory(prefix="weightstream-src-") as tmp, Progress("dump") as progress:
        if hf_dir is None:
            progress.phase(f"writing random weights for {args.preset}")
            hf_dir = save_random_checkpoint(cfg, os.path.join(tmp, "source"), seed=args.seed,
                                            dtype=_dtype(args.megatron_dtype))
        progress.phase(f"starting {layout.world_size} local processes ({layout.describe()}) to write {args.out}")
        progress.follow(os.path.join(tmp, "progress.jsonl"))
        try:
            results = _run_job(layout.world_size, dump_job, hf_dir, layout, args.out, args.bucket_mb,
                               args.megatron_dtype, None, args.writers, None, args.overwrite, None, _quantize(args),
                               os.path.join(tmp, "progress.jsonl"))
        except (UsageError, JobFailure):
            clean_leftovers(out)  # what a rank killed mid-write left beside --out
            raise
    print(_summary(results[0]))
    print(f"copied beside the shards: {', '.join(results[0]['copied']) or 'nothing'}")
    return 0


class JobFailure(Exception):
    """A local job that failed otherwise than on a user error: one line (the failing rank and its exception),
    exit status 1; ``-v`` shows every rank's traceback."""


def _run_job(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """:func:`weightstream.launch.launch`, a rank's failure turned into one line: a :class:`UsageError` where a
    rank said what the user can act on (a :class:`~weightstream.errors.WeightstreamError`), else a
    :class:`JobFailure` naming the rank and the last line of its traceback."""
    from weightstream.launch import LaunchError, launch

    try:
        return launch(world, fn, *args)
    except LaunchError as exc:
        if exc.reasons:
            raise UsageError(exc.reasons[min(exc.reasons)]) from exc
        lines = [line for line in str(exc).splitlines() if line.strip()]
        # The first failing rank's traceback ends where the next rank's begins, or with the message.
        ends = [i for i in range(1, len(lines)) if i + 1 == len(lines) or lines[i + 1].startswith("rank ")]
        first = f"{lines[0].rstrip(':')}: {lines[ends[0]].strip()}" if ends else lines[0]
        raise JobFailure(first) from exc


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
    layout = _layout(args, cfg, engine_tp=args.engine_tp)
    problem = None if args.out is None else _output_problem(Path(os.path.realpath(args.out)), args.overwrite)
    if problem is not None:
        raise UsageError(problem)
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
            # Each rank sends the engine its own shards: rank 0's report counts its share of the bytes and
            # buckets, where the checkpoint (the last line) counts the whole model gathered.
            print(f"      engine update, rank 0's share of {len(results)} ranks: {r['update'].summary()}")
        same_tensors = _demo_compare(src, out)
        same_logits = _demo_logits(results, engine_logits, out, layout)
    proven = same_tensors and same_logits
    verdict = "PROVEN" if proven else "FAILED"
    print(f"{verdict}: {_summary(r)} written (total {time.perf_counter() - start:.1f} s)")
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

    print(f"[3/5] starting {layout.world_size} local processes ({layout.describe()}): build Megatron-Core model, "
          f"load, {'update the engine, ' if server else ''}stream to disk")
    results = _run_job(layout.world_size, dump_job, src, layout, out, args.bucket_mb, "float32", DEMO_INPUT, "rank0",
                       server.url if server else None, args.overwrite, key)
    engine_logits = ReferenceEngine(server.url, api_key=key).logits(DEMO_INPUT) if server else None
    return results, engine_logits


def _demo_compare(src: str, out: str) -> bool:
    """Step 4: every tensor of the written checkpoint against the source, bit for bit; whether all are equal."""
    from weightstream.checks.compare import compare_checkpoints

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
    from weightstream.common.progress import Progress
    from weightstream.convert import convert_checkpoint

    hf, preset = args.hf, args.preset
    if args.hf_config is not None:  # the former --hf-config DIR|PRESET
        if Path(args.hf_config).is_dir():
            hf = args.hf_config
        else:
            try:
                preset = _preset(args.hf_config)
            except argparse.ArgumentTypeError as exc:
                raise UsageError(f"--hf-config {args.hf_config}: not a directory, and {exc}") from None
    hf_dir, cfg = _model(hf, preset)
    if not Path(args.checkpoint).is_dir():
        raise UsageError(f"{args.checkpoint}: no such directory (the Megatron checkpoint to convert)")
    if (problem := _output_problem(Path(os.path.realpath(args.out)), args.overwrite)) is not None:
        raise UsageError(problem)
    with Progress("convert") as progress:
        progress.phase(f"reading {args.checkpoint}")
        report = convert_checkpoint(args.checkpoint, hf_dir if hf_dir is not None else cfg, args.out,
                                    iteration=args.iteration, dtype=_dtype(args.dtype) if args.dtype else None,
                                    bucket_bytes=args.bucket_mb, shard_bytes=args.shard_mb, progress=progress.count,
                                    verify=args.verify, procs=args.procs, overwrite=args.overwrite,
                                    trust_checkpoint=args.trust_checkpoint, quantize=_quantize(args))
    if report.verify is not None:
        print(report.verify.render(args.verify, args.out))
    print(report.summary())
    return 0 if report.verify is None or report.verify.ok else 1


def cmd_verify(args: argparse.Namespace) -> int:
    from weightstream.checks.compare import compare_checkpoints

    missing = [d for d in (args.a, args.b) if not Path(d).is_dir()]
    if missing:
        raise UsageError(f"not a directory: {', '.join(missing)}")
    if args.limit < 0:
        raise UsageError(f"--limit must be 0 (all) or more, got {args.limit}")
    cmp = compare_checkpoints(args.a, args.b, atol=args.atol)
    print(cmp.render(args.a, args.b, limit=args.limit or None))
    return 0 if cmp.ok else 1


def engine_api_key(args: argparse.Namespace) -> str | None:
    """The engine's key: from --api-key-file, else --api-key, else $WEIGHTSTREAM_API_KEY, else none."""
    if args.api_key_file is None:
        return args.api_key or None
    with open(args.api_key_file) as f:
        key = f.readline().strip()
    if not key:
        raise UsageError(f"--api-key-file {args.api_key_file} is empty")
    return key


def _engine_model_problem(model_dir: str) -> str | None:
    """What stops an engine from starting on ``model_dir`` (no config, an unreadable config or weight file),
    found before any worker starts; None when there is nothing (a directory without weights is fine)."""
    from weightstream.common.hf_files import CheckpointReader, NoWeightsError
    from weightstream.errors import WeightstreamError
    from weightstream.models.spec import hf_model_problem

    if not Path(model_dir, "config.json").is_file():
        return f"{model_dir} has no config.json"
    try:
        if (problem := hf_model_problem(model_dir)) is not None:
            return f"{model_dir}: {problem}"
        CheckpointReader(model_dir).close()
    except NoWeightsError:
        return None
    except WeightstreamError as exc:
        return str(exc)
    except (OSError, ValueError) as exc:
        return f"{model_dir}: {exc}"
    return None


def _engine_tp_problem(model_dir: str, tp: int) -> str | None:
    """Why the reference engine cannot split the model of ``model_dir`` (its config read by then) over ``tp``
    ranks; None when it can, or when the model is not one weightstream converts (the engine then says)."""
    from weightstream.converters.registry import known_model_types, model_spec
    from weightstream.models.spec import load_hf_config

    cfg = load_hf_config(model_dir)
    return engine_tp_problem(model_spec(cfg), tp) if cfg.model_type in known_model_types() else None


def _engine_experts(model_dir: str) -> int:
    """The routed experts the engine's model declares (0: dense), from its config.json (read by then)."""
    import json

    from weightstream.receiver.schema import routed_experts

    with open(Path(model_dir, "config.json")) as f:
        return routed_experts(json.load(f))


def cmd_engine(args: argparse.Namespace) -> int:
    import gc
    import signal
    import threading

    from weightstream.common.progress import Progress
    from weightstream.receiver.schema import ep_problem
    from weightstream.receiver.values import LoadChecks
    from weightstream.reference_engine.server import ServerLimits, serve, stop

    problem = (_engine_model_problem(args.hf) or _engine_tp_problem(args.hf, args.tp)
               or ep_problem(args.ep, args.tp, _engine_experts(args.hf)))
    if problem is not None:
        raise UsageError(problem)
    api_key = engine_api_key(args)
    bounds = {"max_batch_tokens": args.max_batch_tokens, "max_request_s": args.max_request_seconds}
    limits = ServerLimits(**{k: v for k, v in bounds.items() if v is not None})
    done = threading.Event()
    got: list[int] = []

    def on_signal(signum, frame) -> None:
        got.append(signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with Progress("engine") as progress:
        progress.phase(f"starting {args.tp} worker process{'es' if args.tp > 1 else ''} on {args.hf}")
        server = serve(args.hf, args.tp, args.host, args.port, api_key, args.device, args.dtype,
                       rollback=not args.no_rollback, limits=limits, ep=args.ep,
                       checks=LoadChecks(refuse_nonfinite=args.refuse_nonfinite))
    ep = f" EP {args.ep}" if args.ep > 1 else ""
    print(f"weightstream engine: {args.hf} (TP {args.tp}{ep}) serving on {server.url}", flush=True)
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
    # Python's exit collects the whole heap (torch's and transformers' modules: 0.8 s on an idle 2-core machine,
    # 2-5 s on a loaded one, most of the 5 s the engine has to stop in); frozen, it is left to the process's end.
    gc.freeze()
    return code


def _bench_delta(args: argparse.Namespace, progress: Progress) -> int:
    """``bench --delta --transport T``: one row per transport (``weightstream.bench.delta``)."""
    from weightstream.bench.delta import run_delta_bench, write_delta_json

    results = []
    for i, transport in enumerate(args.transport):
        progress.phase(f"row {i + 1}/{len(args.transport)}: delta updates by {transport} on {args.preset}")
        res = run_delta_bench(args.preset, transport, tiny=args.tiny, dtype=args.megatron_dtype,
                              bucket_bytes=args.bucket_mb or _mb(BUCKET_MB), lrs=args.lr, steps=args.steps,
                              repeats=args.repeats, masters=args.masters, snapshot=args.snapshot, tp=args.tp,
                              optimizer="host" if args.optimizer_on_host else "device", wire=args.wire)
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


def _bench_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with a ``bench`` command line that argparse cannot see, found before any run."""
    import importlib.util

    problems = []
    if args.soak is None and args.from_json is None and not args.transport:
        problems.append("one of --transport T, --soak N or --from-json F.json is required")
    if args.soak is not None and args.transport and set(args.transport) - set(SOAK_TRANSPORTS):
        problems.append(f"--soak rotates through {', '.join(SOAK_TRANSPORTS)} only, not "
                        f"{', '.join(sorted(set(args.transport) - set(SOAK_TRANSPORTS)))}")
    if args.delta and args.soak is None and set(args.transport or ()) - set(SOAK_TRANSPORTS):
        problems.append(f"--delta times {', '.join(SOAK_TRANSPORTS)} only")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        problems.append("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    if args.plot and args.soak is not None:
        problems.append("--plot charts --transport and --from-json rows, not a --soak report")
    if args.wire != "default":
        from weightstream.bench.speed import wire_problems

        problems += dict.fromkeys(p for t in args.transport or () for p in wire_problems(args.wire, t))
        if args.soak is not None:
            problems.append(f"--wire {args.wire} times --transport and --delta rows, not --soak")
    missing = [f for f in args.from_json or () if not Path(f).is_file()]
    if missing:
        problems.append(f"--from-json: no such file: {', '.join(missing)}")
    return problems


def cmd_bench(args: argparse.Namespace) -> int:
    from weightstream.common.progress import Progress

    problems = _bench_problems(args)
    if problems:
        raise UsageError("; ".join(problems))
    if args.from_json:
        return _bench_from_json(args)
    with Progress("bench") as progress:
        if args.soak is not None:
            return _bench_soak(args, progress)
        if args.delta:
            return _bench_delta(args, progress)
        return _bench_transports(args, progress)


def _bench_from_json(args: argparse.Namespace) -> int:
    """``bench --from-json``: the rows of earlier runs, printed (and charted with --plot)."""
    import json

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


def _bench_transports(args: argparse.Namespace, progress: Progress) -> int:
    """``bench --transport T[,T...]``: one timed row per transport."""
    from weightstream.bench.speed import plot, run_bench, write_json

    results = []
    for i, transport in enumerate(args.transport):
        progress.phase(f"row {i + 1}/{len(args.transport)}: {transport} on {args.preset}")
        res = run_bench(args.preset, transport, tiny=args.tiny, dtype=args.megatron_dtype,
                        bucket_bytes=args.bucket_mb or _mb(BUCKET_MB), repeats=args.repeats,
                        reuse_buffers=args.reuse_buffers, rollback=not args.no_rollback,
                        ahead=not args.per_bucket, tp=args.tp, engine_tp=args.engine_tp, ep=args.ep,
                        prepare=args.prepare, direct=not args.no_direct, quantize=_quantize(args),
                        replicas=args.replicas, wire=args.wire)
        print(res.render(), flush=True)
        results.append(res)
    if args.json:
        write_json(results, args.json)
    if args.plot:
        print(plot(results, args.plot))
    return _rows_status([f"{r.preset} {r.transport}" for r in results if r.failed])


def _bench_soak(args: argparse.Namespace, progress: Progress) -> int:
    """``bench --soak N``: N updates into a reference engine of its own, one report."""
    import json

    from weightstream.bench.soak import run_soak

    report = run_soak(args.soak, transports=args.transport or ("broadcast", "ipc"), switch_every=args.switch_every,
                      preset=args.preset, engine_tp=args.engine_tp or 1,
                      bucket_bytes=args.bucket_mb or _mb(TINY_BUCKET_MB), check_every=args.check_every,
                      sample_every=args.sample_every, progress=progress)
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


def preset_size(values: dict[str, Any]) -> str:
    """A preset's size in words, from its config values alone (no torch): layers, hidden width, heads, experts
    and vocabulary."""
    heads, kv = values["num_attention_heads"], values.get("num_key_value_heads") or values["num_attention_heads"]
    parts = [f"{values['num_hidden_layers']} layers", f"hidden {values['hidden_size']}",
             f"{heads} heads" + (f" ({kv} kv)" if kv != heads else "")]
    experts = values.get("num_experts") or values.get("num_local_experts") or values.get("n_routed_experts")
    if experts:
        parts.append(f"{experts} experts (top {values['num_experts_per_tok']})")
    parts.append(f"vocab {values['vocab_size']:,}")
    return ", ".join(parts)


def cmd_presets(args: argparse.Namespace) -> int:
    from weightstream.models.presets import PRESETS

    rows = [("preset", "model_type", "size")]
    rows += [(name, PRESETS[name]["model_type"], preset_size(PRESETS[name])) for name in sorted(PRESETS)]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for name, model_type, size in rows:
        print(f"{name.ljust(widths[0])}  {model_type.ljust(widths[1])}  {size}")
    print(f"{len(rows) - 1} presets; use one with --preset NAME (demo, dump, convert, bench)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command; its exit status. A user error (a :class:`UsageError`, a
    :class:`~weightstream.errors.WeightstreamError`, a ValueError or OSError from what the user gave) is one
    ``error:`` line and status 2; a local job that failed otherwise one line and status 1; with ``-v``, the
    traceback first."""
    from weightstream.common.quiet import quiet_command
    from weightstream.errors import WeightstreamError

    args = build_parser().parse_args(argv)
    quiet_command(args.verbose)
    if args.plugin:  # before the command runs; exported to the processes it starts
        from weightstream.converters.registry import PluginError, load_plugins

        try:
            load_plugins(args.plugin, search=os.getcwd())
        except PluginError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    handler = {"demo": cmd_demo, "dump": cmd_dump, "verify": cmd_verify, "engine": cmd_engine, "bench": cmd_bench,
               "convert": cmd_convert, "families": cmd_families, "example": cmd_example,
               "presets": cmd_presets}[args.command]
    try:
        return handler(args)
    except BrokenPipeError:  # the reader went away (| head): what it did not read is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit would fail)
        return 0
    except (UsageError, ValueError, OSError, WeightstreamError, JobFailure) as exc:
        if args.verbose:
            import traceback

            traceback.print_exc()
        print(f"error: {_one_line(exc)}", file=sys.stderr, flush=True)
        return 1 if isinstance(exc, JobFailure) else 2


if __name__ == "__main__":
    sys.exit(main())
