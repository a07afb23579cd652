"""The model families over real Megatron-Core models in real gloo jobs, one suite over a table of families:
Llama (3.1 untied, 3.2 tied, both with Llama 3 rotary scaling) and Mistral, Mixtral, GLM-4.5 MoE (``glm4_moe``)
and DeepSeek-V3 (``deepseek_v3``, multi-latent attention).

For every family and every layout of its table (TP 2 with grouped-query attention, PP 2 with the last stage's
copy of a tied embedding, PP 2 x VPP 2, EP 2 with shared experts, expert-TP 2, TP 2 x EP 2, ...; per-rank mode;
Transformer Engine and grouped-GEMM names; block FP8; bf16 with the expert bias in float32): every HF tensor
bit-identical to what ``save_pretrained`` writes, exactly its keys, and the Megatron model's logits equal to the
HF model's. Then, from the same one two-process launch per family: a Megatron checkpoint converted bit for bit,
an update into a reference engine of TP 2 whose logits then equal the HF model's, and transformers' model under
FSDP2 streamed as saved; and transformers' own models (fused experts in memory) streamed without a process group.
What is a family's own (its declarations, real shapes, refusals, rotary scaling, multi-token prediction layers,
Transformer Engine's whole down projections) is tested by the explicit tests below the table."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conftest import hf_logits
from tests.helpers.checks import (
    INPUT_IDS,
    assert_full_exact,
    assert_logits_close,
    assert_per_rank_assembles,
    assert_per_rank_experts,
    by_label,
)
from tests.helpers.family_workers import run_family_cases, run_family_job
from tests.helpers.mtp_checkpoint import save_mtp_checkpoint
from tests.helpers.workers import Case
from weightstream.common.hf_files import CheckpointReader
from weightstream.common.layout import ALIGN
from weightstream.convert import convert_checkpoint
from weightstream.converters import NotRepresentable, OpContext, get_converter, model_spec
from weightstream.converters.expected import expected_hf_shapes
from weightstream.converters.qwen2 import QWEN2
from weightstream.errors import ConversionError
from weightstream.jobs import Layout
from weightstream.launch import launch
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint
from weightstream.models.spec import Llama3Rope
from weightstream.streaming.plan import plan_buckets
from weightstream.streaming.stream import stream_hf_weights
from weightstream.wire.fp8 import BlockFP8

FULL, ASSEMBLES, EXPERTS = "full", "assembles", "experts"  # what a layout's streams are checked against
FP8 = BlockFP8(block=(16, 16))  # the tiny models' shapes are not multiples of 128


@dataclass(frozen=True, slots=True)
class Run:
    """One Megatron layout of a family's job and what its stream must be.

    ``check``: FULL (every rank yields every HF tensor, bit-identical to the source's, exactly its keys),
    ASSEMBLES (per-rank mode: the TP ranks' shards put together are the source) or EXPERTS (per-rank mode with
    routed experts: each rank yields its EP rank's experts, cut by expert-TP, and the pieces are the source).
    ``logits``: the Megatron model's logits equal the HF model's. ``gathers``/``broadcasts``: whether the stream
    gathered/broadcast (None: not checked). ``names_in``/``names_out``: names the stream must/must not yield;
    ``tensors``: how many it yields. ``written``: the job also writes the model's checkpoint, which must equal
    the source. ``te_reload``: the model is presented under Transformer Engine's names, zeroed, loaded again
    into those names and streamed. ``world``: the processes of its launch."""

    label: str
    source: str
    layout: Layout
    check: str = FULL
    logits: bool = False
    te_names: bool = False
    grouped_experts: bool = False
    quantize: BlockFP8 | None = None
    dtype: str = "float32"
    gathers: bool | None = None
    broadcasts: bool | None = None
    names_in: tuple[str, ...] = ()
    names_out: tuple[str, ...] = ()
    tensors: int | None = None
    written: bool = False
    te_reload: bool = False
    world: int = 2

    def case(self, sources: dict[str, str], root: Path) -> Case:
        if self.te_reload:
            return Case(sources[self.source], self.layout, label=self.label)
        return Case(sources[self.source], self.layout, mode="full" if self.check == FULL else "per_rank",
                    dtype=self.dtype, te_names=self.te_names, logits=self.logits, label=self.label,
                    grouped_experts=self.grouped_experts, quantize=self.quantize,
                    save_to=str(root / f"written {self.label}") if self.written else None)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A model the stream must refuse: ``mutate`` (as :func:`tests.helpers.workers.run_error_case` takes it) and
    overrides of the HF config it is streamed for. What the error lists is checked by the family's own test."""

    label: str
    source: str
    layout: Layout
    mutate: str = ""
    overrides: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Trainer:
    """A Megatron job's layout over one of the family's sources (a checkpoint it saves, or an update it sends)."""

    source: str
    layout: Layout


@dataclass(frozen=True, slots=True)
class Family:
    """One row of the table: how its checkpoints are written, its layouts, and its family-specific data.

    ``write_sources(root)``: the random HF checkpoints by key, ``engine`` among them (where the reference
    engine starts). ``in_memory``: (preset, seed) of transformers' models made in bf16, saved and streamed
    without a process group; ``float32_in_memory``: the name ending of tensors such a model keeps in float32.
    ``saved``: the layout whose Megatron checkpoint is saved, then converted from each of ``formats``.
    ``update``: the trainer that updates a TP 2 reference engine (``update_bucket_bytes``,
    ``weight_version``). ``fsdp``: the source streamed by transformers' model under FSDP2 over two ranks
    (None: not this family), ``fsdp_placements`` its DTensor placements where checked exactly."""

    name: str
    write_sources: Callable[[Path], dict[str, str]]
    runs: tuple[Run, ...]
    in_memory: tuple[tuple[str, int], ...]
    saved: Trainer
    update: Trainer
    formats: tuple[str, ...] = ("torch_dist", "legacy")
    refusals: tuple[Refusal, ...] = ()
    experts: int = 0
    logits_atol: float = 1e-5
    reference_min: float = 0.1  # the reference logits are far from zero: equal logits mean something
    float32_in_memory: str | None = None
    update_bucket_bytes: int = 120_000
    weight_version: str | None = None
    fsdp: str | None = None
    fsdp_placements: frozenset[str] | None = None
    in_memory_unit: bool = False  # its in-memory test belongs to the fast ``-m unit`` subset


# -- the checkpoints each family is written from --------------------------------------------------------------

LLAMAS = ("tiny-llama", "tiny-llama-tied", "tiny-mistral")
LORA, QPROJ = "tiny-deepseek-v3", "tiny-deepseek-v3-q-proj"


def _save_moe(cfg, out: Path, seed: int, dtype: torch.dtype = torch.float32) -> str:
    """A random MoE checkpoint in ``dtype``: the routers in ``dtype`` too, as a Megatron model of that dtype holds
    them, and the score-correction biases in float32, as the published checkpoints hold them and Megatron keeps
    its expert bias. Both are set here because transformers' from_config decides their dtypes by version (5.19
    makes both bf16; 5.24 keeps both float32, `_keep_in_fp32_modules_strict`)."""
    model = random_hf_model(cfg, seed=seed, dtype=dtype)
    for layer in model.model.layers[cfg.first_k_dense_replace:]:
        layer.mlp.gate.weight.data = layer.mlp.gate.weight.data.to(dtype)
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    model.save_pretrained(out)
    return os.fspath(out)


def _air_like():
    """GLM-4.5-Air's kind of config: no q/k norm, no expert groups, weights not scaled."""
    cfg = preset_config("tiny-glm4-moe")
    cfg.use_qk_norm, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor = False, 1, 1, 1.0
    return cfg


def _llama_sources(root: Path) -> dict[str, str]:
    out = {name: save_random_checkpoint(preset_config(name), root / name, seed=90 + i)
           for i, name in enumerate(LLAMAS)}
    return {**out, "engine": save_random_checkpoint(preset_config("tiny-llama-tied"), root / "engine", seed=5)}


def _mixtral_sources(root: Path) -> dict[str, str]:
    cfg = preset_config("tiny-mixtral")
    return {"mixtral": save_random_checkpoint(cfg, root / "mixtral", seed=95),
            "engine": save_random_checkpoint(cfg, root / "engine", seed=7)}


def _glm_sources(root: Path) -> dict[str, str]:
    """The preset (q/k norm, grouped top-k, scaled weights), GLM-4.5-Air's kind, the preset in bf16 (the routers
    bf16, the biases float32); score-correction biases random too."""
    cfg = preset_config("tiny-glm4-moe")
    return {"glm": _save_moe(cfg, root / "glm", 60), "air": _save_moe(_air_like(), root / "air", 61),
            "bf16": _save_moe(cfg, root / "bf16", 62, torch.bfloat16), "engine": _save_moe(cfg, root / "engine", 63)}


def _deepseek_sources(root: Path) -> dict[str, str]:
    """Both presets (q_lora_rank set and null), the first in bf16, and a checkpoint with one multi-token
    prediction layer (``model.layers.4.*``), as DeepSeek-V3's hold them."""
    out = {name: save_random_checkpoint(preset_config(name), root / name, seed=80 + i)
           for i, name in enumerate((LORA, QPROJ))}
    mtp = preset_config(LORA)
    mtp.num_nextn_predict_layers = 1
    return {**out, "bf16": _save_moe(preset_config(LORA), root / "bf16", 84, torch.bfloat16),
            "mtp": save_mtp_checkpoint(mtp, str(root / "mtp"), seed=85),
            "engine": save_random_checkpoint(preset_config(LORA), root / "engine", seed=86)}


# -- the table ---------------------------------------------------------------------------------------------------

MIXTRAL_MOE = "model.layers.3.block_sparse_moe"

LLAMA = Family(
    name="llama",
    write_sources=_llama_sources,
    runs=(
        Run("tp2 llama", "tiny-llama", Layout(2, 1), logits=True, written=True),
        Run("tp2 tied", "tiny-llama-tied", Layout(2, 1), logits=True),  # one KV head per rank
        Run("tp2 mistral", "tiny-mistral", Layout(2, 1), logits=True),
        Run("pp2 vpp2 llama", "tiny-llama", Layout(1, 2, vpp=2), logits=True),
        Run("pp2 tied", "tiny-llama-tied", Layout(1, 2), logits=True),  # the last stage's copy of the embedding
        Run("tp2 per_rank tied", "tiny-llama-tied", Layout(2, 1), check=ASSEMBLES, gathers=False),
        Run("tp2 per_rank mistral", "tiny-mistral", Layout(2, 1), check=ASSEMBLES, gathers=False),
        Run("tp2 te tied", "tiny-llama-tied", Layout(2, 1), te_names=True),
        Run("pp2 te llama", "tiny-llama", Layout(1, 2), te_names=True),
        Run("tp2 fp8 tied", "tiny-llama-tied", Layout(2, 1), quantize=FP8,
            names_in=("model.layers.3.mlp.down_proj.weight_scale_inv",)),
    ),
    in_memory=(("tiny-llama-tied", 97), ("tiny-mistral", 98)),  # tied: the embedding once
    saved=Trainer("tiny-llama-tied", Layout(1, 2)),  # the last stage's copy of the embedding is on disk too
    update=Trainer("tiny-llama-tied", Layout(2, 1)),  # each rank its own shards, the vocabulary re-split
    update_bucket_bytes=60_000,
    weight_version="llama-1",
)

MIXTRAL = Family(
    name="mixtral",
    write_sources=_mixtral_sources,
    runs=(
        Run("ep2", "mixtral", Layout(1, 1, ep=2), logits=True, gathers=False, broadcasts=True),
        Run("etp2", "mixtral", Layout(1, 1, ep=1, etp=2), logits=True),
        Run("tp2", "mixtral", Layout(2, 1, ep=1), logits=True),  # experts over expert-TP = TP = 2
        Run("pp2", "mixtral", Layout(1, 2, ep=1), logits=True),
        Run("tp2 ep2", "mixtral", Layout(2, 1, ep=2, etp=1), logits=True),  # attention over TP, experts over EP
        # Block FP8 as the family declares it: attention and experts quantized, never the router.
        Run("ep2 fp8", "mixtral", Layout(1, 1, ep=2), quantize=FP8,
            names_in=(f"{MIXTRAL_MOE}.experts.7.w2.weight_scale_inv",),
            names_out=(f"{MIXTRAL_MOE}.gate.weight_scale_inv",)),
        Run("ep2 te grouped", "mixtral", Layout(1, 1, ep=2), te_names=True, grouped_experts=True),
        Run("ep2 per_rank", "mixtral", Layout(1, 1, ep=2), check=EXPERTS, gathers=False, broadcasts=False),
        Run("etp2 per_rank", "mixtral", Layout(1, 1, ep=1, etp=2), check=EXPERTS, gathers=False, broadcasts=False),
    ),
    refusals=(Refusal("expert bias", "mixtral", Layout(1, 1, ep=2), mutate="expert_bias"),),
    experts=8,
    in_memory=(("tiny-mixtral", 96),),  # mlp.gate and fused experts in memory
    saved=Trainer("mixtral", Layout(1, 1, ep=2)),  # legacy per-rank files, experts from both EP ranks
    formats=("legacy",),
    update=Trainer("mixtral", Layout(1, 1, ep=2)),  # resharded P2P: the engine splits the fused experts
    update_bucket_bytes=60_000,
    weight_version="mixtral-1",
    fsdp="mixtral",
    fsdp_placements=frozenset({"(Shard(dim=0),)"}),
)

GLM4_MOE = Family(
    name="glm4_moe",
    write_sources=_glm_sources,
    runs=(
        Run("tp2", "glm", Layout(2, 1), logits=True),
        Run("pp2", "glm", Layout(1, 2), logits=True),  # stage 0: the dense layer and an MoE layer
        Run("pp2 vpp2", "glm", Layout(1, 2, vpp=2), logits=True),  # one layer per chunk
        Run("ep2", "glm", Layout(1, 1, ep=2), logits=True),
        Run("ep2 air", "air", Layout(1, 1, ep=2), logits=True),
        Run("etp2", "glm", Layout(1, 1, ep=1, etp=2), logits=True),
        Run("tp2 ep2", "glm", Layout(2, 1, ep=2, etp=1), logits=True),
        Run("ep2 te grouped", "glm", Layout(1, 1, ep=2), te_names=True, grouped_experts=True),
        Run("ep2 bf16", "bf16", Layout(1, 1, ep=2), dtype="bfloat16"),  # the expert bias float32, as Megatron's
        Run("tp2 per_rank", "glm", Layout(2, 1), check=ASSEMBLES),
        Run("ep2 per_rank", "glm", Layout(1, 1, ep=2), check=EXPERTS, gathers=False, broadcasts=False),
    ),
    experts=8,
    in_memory=(("tiny-glm4-moe", 5),),
    float32_in_memory="e_score_correction_bias",
    in_memory_unit=True,
    saved=Trainer("glm", Layout(1, 2)),  # a dense stage then MoE, the expert bias among its buffers
    update=Trainer("glm", Layout(1, 1, ep=2)),  # projections, shared and fused experts split; router whole
    fsdp="glm",
)

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    write_sources=_deepseek_sources,
    runs=(
        Run("tp2", LORA, Layout(2, 1), logits=True),
        Run("tp2 q_proj", QPROJ, Layout(2, 1), logits=True),
        Run("pp2", LORA, Layout(1, 2), logits=True),  # stage 0: layers 0-1 dense; stage 1: MoE
        Run("ep2", LORA, Layout(1, 1, ep=2), logits=True),
        Run("ep2 q_proj", QPROJ, Layout(1, 1, ep=2), logits=True),
        Run("etp2", LORA, Layout(1, 1, ep=1, etp=2), logits=True),
        Run("ep2 te grouped", LORA, Layout(1, 1, ep=2), te_names=True, grouped_experts=True),
        Run("tp2 per_rank", LORA, Layout(2, 1), check=ASSEMBLES),
        Run("ep2 per_rank", QPROJ, Layout(1, 1, ep=2), check=EXPERTS),
        # Multi-token prediction layers streamed (TP 2, EP 2, PP 2: the last stage's embedding copy) and loaded:
        # the decoder's 103 tensors, then layer 4's 44: its own, copies, an MoE layer.
        Run("mtp tp2", "mtp", Layout(2, 1), logits=True, tensors=103 + 44),
        Run("mtp ep2", "mtp", Layout(1, 1, ep=2), tensors=103 + 44),
        Run("mtp pp2", "mtp", Layout(1, 2), logits=True, tensors=103 + 44),
        Run("tp2 fp8", LORA, Layout(2, 1), quantize=FP8),
        Run("ep2 bf16", "bf16", Layout(1, 1, ep=2), dtype="bfloat16"),
        Run(f"tp2 te reload {LORA}", LORA, Layout(2, 1), te_reload=True),
        Run(f"tp2 te reload {QPROJ}", QPROJ, Layout(2, 1), te_reload=True),
        Run("tp2 ep2", LORA, Layout(2, 1, ep=2), logits=True, world=4),
        Run("tp2 pp2", QPROJ, Layout(2, 2), logits=True, world=4),
        Run("pp2 vpp2 ep2", LORA, Layout(1, 2, vpp=2, ep=2), logits=True, world=4),
    ),
    # MTP layers where only one side has them: refused.
    refusals=(Refusal("mtp not in config", "mtp", Layout(1, 1), overrides={"num_nextn_predict_layers": 0}),
              Refusal("mtp not in model", LORA, Layout(1, 1), overrides={"num_nextn_predict_layers": 1})),
    experts=8,
    in_memory=((LORA, 90), (QPROJ, 91)),  # routed experts fused in memory, the router's bias a buffer
    saved=Trainer(LORA, Layout(2, 1)),  # MLA heads and down projections split in its files
    update=Trainer(LORA, Layout(1, 1, ep=2)),  # q_b/kv_b by heads, o_proj by input, latents whole
    fsdp=LORA,
)

FAMILIES = (LLAMA, MIXTRAL, GLM4_MOE, DEEPSEEK_V3)


def _params(families=FAMILIES, unit: Callable[[Family], bool] = lambda f: False) -> list:
    return [pytest.param(f, id=f.name, marks=[pytest.mark.unit] if unit(f) else []) for f in families]


# -- each family's checkpoints, references and jobs, made once per module on first use ------------------------


class FamilyJobs:
    """Each family's checkpoints, the HF models' reference logits and its Megatron jobs (one two-process launch,
    one four-process launch where it has such layouts), each made on first use and kept for the module."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._roots: dict[str, Path] = {}
        self._sources: dict[str, dict[str, str]] = {}
        self._references: dict[tuple[str, str], torch.Tensor] = {}
        self._jobs: dict[tuple[str, int], dict] = {}

    def root(self, family: Family) -> Path:
        if family.name not in self._roots:
            self._roots[family.name] = self._tmp.mktemp(family.name)
        return self._roots[family.name]

    def sources(self, family: Family) -> dict[str, str]:
        if family.name not in self._sources:
            self._sources[family.name] = family.write_sources(self.root(family) / "hf")
        return self._sources[family.name]

    def reference(self, family: Family, source: str) -> torch.Tensor:
        """The logits of transformers' model loaded from the source (far from zero, checked)."""
        key = (family.name, source)
        if key not in self._references:
            ref = hf_logits(self.sources(family)[source], INPUT_IDS)
            assert ref.abs().max().item() > family.reference_min
            self._references[key] = ref
        return self._references[key]

    def job(self, family: Family, world: int = 2) -> dict:
        if (family.name, world) not in self._jobs:
            launch_job = self._launch_world2 if world == 2 else self._launch_world4
            self._jobs[(family.name, world)] = launch_job(family)
        return self._jobs[(family.name, world)]

    def _launch_world4(self, family: Family) -> dict:
        src, root = self.sources(family), self.root(family)
        cases = [run.case(src, root) for run in family.runs if run.world == 4]
        return {"cases": by_label(launch(4, run_family_cases, cases))}

    def _launch_world2(self, family: Family) -> dict:
        """The layouts, refusals, the saved checkpoint, the update and FSDP2, in one launch of two processes."""
        from weightstream.engines import ReferenceEngine
        from weightstream.reference_engine.server import serve, stop

        src, root = self.sources(family), self.root(family)
        runs = [run for run in family.runs if run.world == 2]
        cases = [run.case(src, root) for run in runs if not run.te_reload]
        te = [run.case(src, root) for run in runs if run.te_reload]
        errors = [(Case(src[r.source], r.layout, label=r.label), r.mutate, r.overrides) for r in family.refusals]
        saves = [(Case(src[family.saved.source], family.saved.layout), str(root / "megatron"))]
        fsdp = [("run_fsdp_stream", src[family.fsdp], (2,), ["full"])] if family.fsdp else []
        options = {"transport": "auto", "bucket_bytes": family.update_bucket_bytes,
                   "weight_version": family.weight_version}
        server = serve(src["engine"], 2)
        try:
            before = ReferenceEngine(server.url).logits(INPUT_IDS)
            update = (Case(src[family.update.source], family.update.layout), [server.url], [options])
            results = launch(2, run_family_job, cases, te, errors, saves, update, fsdp)
        finally:
            stop(server)
        return {"cases": by_label([r["cases"] for r in results]), "saves": [r["saves"][0] for r in results],
                "update": results[0]["update"][0], "engine_before": before, "megatron": root / "megatron",
                "fsdp": [r["fsdp"][0] for r in results if r["fsdp"]], "root": root}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> FamilyJobs:
    return FamilyJobs(tmp_path_factory)


def _saved(src: str) -> dict[str, torch.Tensor]:
    with CheckpointReader(src) as reader:
        return {n: reader.get(n).clone() for n in reader.keys()}


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in dtype or in any bit of their values."""
    return [n for n, t in got.items() if t.dtype != want[n].dtype or not torch.equal(t, want[n])]


# -- the suite over the table ------------------------------------------------------------------------------------


def _check_run(family: Family, run: Run, results: list[dict], src: str) -> None:
    """What one layout's ranks yielded, against the source: as the run's check says, then its extras."""
    layout = run.layout
    assert len(results) == run.world, run.label
    if run.check == FULL:
        assert_full_exact(results, src, run.quantize)
    elif run.check == ASSEMBLES:
        assert_per_rank_assembles(results, src, tp=layout.tp)
    else:
        assert_per_rank_experts(results, src, family.experts, ep=layout.ep, tp=layout.tp, etp=layout.etp or layout.tp)
    for r in results:
        if run.gathers is not None:
            assert (r["stats"].gathers > 0) == run.gathers, (run.label, r["stats"])
        if run.broadcasts is not None:
            assert (r["stats"].broadcasts > 0) == run.broadcasts, (run.label, r["stats"])
        if run.check == FULL:
            assert set(run.names_in) <= set(r["names"]) and not set(run.names_out) & set(r["names"]), run.label
            assert run.tensors is None or len(r["names"]) == run.tensors, run.label


def _check_runs(jobs: FamilyJobs, family: Family, world: int) -> None:
    from weightstream.checks.compare import compare_checkpoints

    src, results = jobs.sources(family), jobs.job(family, world)["cases"]
    for run in (run for run in family.runs if run.world == world):
        _check_run(family, run, results[run.label], src[run.source])
        if run.logits:
            ref = jobs.reference(family, run.source)
            for r in results[run.label]:
                assert_logits_close(r["logits"], ref, atol=family.logits_atol)
        if run.written:
            cmp = compare_checkpoints(src[run.source], jobs.root(family) / f"written {run.label}")
            assert cmp.ok and cmp.compared == len(_saved(src[run.source])), run.label


@pytest.mark.parametrize("family", _params())
def test_layouts_bit_identical_exact_keys_equal_logits(jobs, family):
    _check_runs(jobs, family, world=2)


@pytest.mark.parametrize("family", _params([f for f in FAMILIES if any(run.world == 4 for run in f.runs)]))
def test_layouts_of_four_processes(jobs, family):
    _check_runs(jobs, family, world=4)


@pytest.mark.parametrize(("family", "fmt"), [pytest.param(f, fmt, id=f"{f.name}-{fmt}")
                                             for f in FAMILIES for fmt in f.formats])
def test_megatron_checkpoint_converts(jobs, family, fmt, tmp_path):
    """The saved job's checkpoint converted by ``convert_checkpoint``: bit for bit the HF checkpoint it was built
    from; the job's logits (every rank) and the converted checkpoint's equal the HF model's."""
    src = jobs.sources(family)[family.saved.source]
    job, ref = jobs.job(family), jobs.reference(family, family.saved.source)
    report = convert_checkpoint(job["megatron"] / fmt, src, tmp_path / "hf", bucket_bytes=40_000, verify=src)
    assert report.verify is not None and report.verify.ok, report.verify.render(src, str(tmp_path / "hf"))
    assert report.verify.compared == len(_saved(src))
    for saved in job["saves"]:
        assert_logits_close(saved["logits"], ref)
    converted = hf_logits(str(tmp_path / "hf"), INPUT_IDS)
    assert_logits_close(converted, ref)
    assert_logits_close(converted, job["saves"][-1]["logits"])


@pytest.mark.parametrize("family", _params())
def test_update_into_the_reference_engine(jobs, family):
    """The trainer updates a reference engine of TP 2 from other weights, by resharded point-to-point sends, and
    the engine's logits then equal the HF model's."""
    job, src = jobs.job(family), jobs.sources(family)[family.update.source]
    entry, ref = job["update"], jobs.reference(family, family.update.source)
    assert "error" not in entry, entry.get("error")
    assert (job["engine_before"] - ref).abs().max() > 1e-2
    report, version = entry["report"], family.weight_version or "1"  # none given: the updates counted from 1
    assert (report.transport, report.weight_version, report.tensors) == ("p2p", version, len(_saved(src)))
    assert_logits_close(entry["engine_logits"], ref)


@pytest.mark.parametrize("family", _params([f for f in FAMILIES if f.fsdp]))
def test_fsdp2_model_streams_as_saved(jobs, family):
    """transformers' model under FSDP2 (2 ranks, fused experts sharded), streamed in full mode twice (the second
    from the kept plan): bit for bit what ``save_pretrained`` wrote."""
    want = _saved(jobs.sources(family)[family.fsdp])
    outs = jobs.job(family)["fsdp"]
    assert len(outs) == 2
    for out in outs:
        placements = set(out["placements"].values())
        assert any("Shard" in p for p in placements)
        assert family.fsdp_placements is None or placements == family.fsdp_placements
        for stream in (out["full"], out["again"]):
            assert stream["tensors"].keys() == want.keys() and stream["gathers"] > 0
            assert _differing(stream["tensors"], want) == []


@pytest.mark.parametrize("family", _params(unit=lambda f: f.in_memory_unit))
def test_transformers_model_in_memory_streams_as_saved(family, tmp_path):
    """No process group: transformers' own model, in bf16 (fused experts in memory, buffers such as the router's
    bias), streams exactly as ``save_pretrained`` writes it."""
    for preset, seed in family.in_memory:
        model = random_hf_model(preset_config(preset), seed=seed, dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / preset)
        want = _saved(str(tmp_path / preset))
        got = {n: t.clone() for b in stream_hf_weights(model, tmp_path / preset, bucket_bytes=60_000)
               for n, t in b.named_tensors()}
        assert got.keys() == want.keys(), preset
        assert _differing(got, want) == [], preset
        if family.float32_in_memory:
            assert {want[n].dtype for n in want if n.endswith(family.float32_in_memory)} == {torch.float32}


# -- Llama and Mistral -------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_llama_is_qwen2_without_the_qkv_bias_and_mistral_is_llama():
    llama, mistral = get_converter("llama"), get_converter("mistral")
    assert [m.megatron for m in QWEN2.mappings if m not in llama.mappings] == [
        "decoder.layers.*.self_attention.linear_qkv.bias"]
    assert mistral.mappings == llama.mappings and mistral.fp8 == llama.fp8 == QWEN2.fp8
    shapes = expected_hf_shapes(preset_config("tiny-llama-tied"))
    assert "lm_head.weight" not in shapes and len(shapes) == 2 + 9 * 4
    assert [n for n in shapes if llama.quantizes(n)] == [n for n in shapes if n.endswith("_proj.weight")]
    # The rotary scaling is read into the spec, for the Megatron model built for it.
    spec = model_spec(preset_config("tiny-llama-tied"))
    assert (spec.rope_type, spec.llama3_rope, spec.rope_theta) == ("llama3", Llama3Rope(32.0, 1.0, 4.0, 8192), 5e5)
    assert (spec.head_dim, spec.q_per_group, spec.qkv_bias) == (8, 4, False)
    assert model_spec(preset_config("tiny-mistral")).head_dim == 16  # not hidden / heads


def test_what_the_llama_family_cannot_carry_is_refused_naming_it():  # not unit: it imports Megatron-Core
    from weightstream.checks.megatron_models import _rope_scaling

    biased = preset_config("tiny-llama")
    biased.attention_bias, biased.mlp_bias = True, True
    with pytest.raises(ValueError, match="llama configs with attention_bias and mlp_bias are not supported"):
        model_spec(biased)
    assert _rope_scaling(model_spec(preset_config("tiny-llama"))) == {"rope_scaling": True, "rope_scaling_factor": 8.0}
    assert _rope_scaling(model_spec(preset_config("tiny-mistral"))) == {}
    odd = preset_config("tiny-llama")
    odd.rope_parameters = {**odd.rope_parameters, "low_freq_factor": 2.0}
    linear = preset_config("tiny-mistral")
    linear.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    for cfg, what in ((odd, "low_freq_factor=2.0"), (linear, "rope_type 'linear'")):
        with pytest.raises(ConversionError) as err:
            _rope_scaling(model_spec(cfg))
        assert what in str(err.value)


def test_llama_rotary_scaling_reaches_the_logits_and_the_config_written(jobs, tmp_path):
    """The rotary scaling matters to the logits (the same weights without it differ by far more than the
    tolerance), so the Megatron model computes it; and the config written with the checkpoint keeps it."""
    ref = jobs.reference(LLAMA, "tiny-llama")
    plain = preset_config("tiny-llama")
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    unscaled = save_random_checkpoint(plain, tmp_path / "unscaled", seed=90)  # the weights of the source
    assert (hf_logits(unscaled, INPUT_IDS) - ref).abs().max() > 1e-4
    jobs.job(LLAMA)
    written = jobs.root(LLAMA) / "written tp2 llama"
    config = json.loads((written / "config.json").read_text())
    assert config["rope_parameters"] == preset_config("tiny-llama").rope_parameters
    assert_logits_close(hf_logits(str(written), INPUT_IDS), ref)


@pytest.mark.unit
def test_llama_3_1_8b_preset_has_the_real_shapes():
    """``llama-3.1-8b`` (for ``weightstream bench``): Meta's 8,030,261,248 parameters in 291 HF tensors."""
    shapes = expected_hf_shapes(preset_config("llama-3.1-8b"))
    assert len(shapes) == 291 and sum(math.prod(s) for s in shapes.values()) == 8_030_261_248
    assert shapes["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
    assert model_spec(preset_config("llama-3.1-8b")).llama3_rope == Llama3Rope(8.0, 1.0, 4.0, 8192)


# -- Mixtral -----------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_mixtral_declarations_and_its_in_memory_form():
    m = MIXTRAL_MOE
    conv, llama = get_converter("mixtral"), get_converter("llama")
    spec = model_spec(preset_config("tiny-mixtral"))
    assert (spec.num_experts, spec.moe_top_k, spec.norm_topk_prob, spec.moe_intermediate_size) == (8, 2, True, 32)
    assert spec.dense_layers == frozenset() and spec.moe_score_function == "softmax"
    removed = {x.megatron for x in llama.mappings} - {x.megatron for x in conv.mappings}
    assert removed == {"decoder.layers.*.mlp.linear_fc1.layer_norm_weight", "decoder.layers.*.mlp.linear_fc1.weight",
                       "decoder.layers.*.mlp.linear_fc2.weight"}
    fc1 = conv.resolve("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", spec)
    assert fc1.hf_names == (f"{m}.experts.5.w1.weight", f"{m}.experts.5.w3.weight")
    assert fc1.mapping.tp_group == "etp" and fc1.mapping.tp_dim == 0
    assert conv.resolve("decoder.layers.3.mlp.experts.linear_fc2.weight5", spec).hf_names == (
        f"{m}.experts.5.w2.weight",)
    assert conv.resolve("decoder.layers.3.mlp.router.weight", spec).hf_names == (f"{m}.gate.weight",)
    # Block FP8: the attention projections and the experts, not the router, norms or embeddings.
    shapes = expected_hf_shapes(preset_config("tiny-mixtral"))
    assert len(shapes) == 3 + 4 * (7 + 3 * MIXTRAL.experts)
    assert sorted(n for n in shapes if conv.quantizes(n)) == sorted(
        n for n in shapes if n.endswith("_proj.weight") or ".experts." in n)
    # transformers' in-memory names and fused experts become the checkpoint's, expert by expert.
    memory = conv.in_memory()
    assert memory.resolve("model.layers.3.mlp.gate.weight", spec).hf_names == (f"{m}.gate.weight",)
    gate_up = memory.resolve("model.layers.3.mlp.experts.gate_up_proj", spec)
    assert gate_up.hf_names[:4] == (f"{m}.experts.0.w1.weight", f"{m}.experts.0.w3.weight",
                                    f"{m}.experts.1.w1.weight", f"{m}.experts.1.w3.weight")
    assert len(gate_up.hf_names) == 2 * MIXTRAL.experts


def test_mixtral_megatron_expert_bias_is_refused_naming_each(jobs):
    """Megatron's aux-loss-free expert bias has no place in Mixtral (it routes by a softmax): streaming a model
    that holds it, and loading the checkpoint into one, are refused, every layer's named."""
    results = jobs.job(MIXTRAL)["cases"]["expert bias"]
    assert len(results) == 2
    for r in results:
        for err in (r, r["load"]):
            refused = err["problems"]["Megatron tensors the HF model has no place for"]
            assert [x.split(":")[0] for x in refused] == [f"decoder.layers.{i}.mlp.router.expert_bias"
                                                          for i in range(4)]
            assert "Mixtral routes by a softmax" in refused[0]


# -- GLM-4.5 MoE -------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_glm4_moe_features_follow_the_hf_config():
    s = model_spec(preset_config("tiny-glm4-moe"))
    assert (s.qkv_bias, s.qk_norm, s.partial_rotary_factor, s.dense_layers) == (True, True, 0.5, frozenset({0}))
    assert (s.num_experts, s.moe_top_k, s.moe_intermediate_size, s.shared_expert_intermediate_size,
            s.shared_expert_gate) == (8, 2, 32, 32, False)
    assert (s.moe_score_function, s.moe_expert_bias, s.moe_num_groups, s.moe_group_top_k,
            s.moe_routed_scaling_factor, s.norm_topk_prob) == ("sigmoid", True, 2, 1, 2.5, True)
    air = model_spec(preset_config("glm-4.5-air"))
    assert (air.num_layers, air.num_experts, air.moe_top_k, air.head_dim, air.hidden_size, air.qk_norm,
            air.dense_layers, air.shared_expert_intermediate_size) == (46, 128, 8, 128, 4096, False,
                                                                        frozenset({0}), 1408)
    # n_shared_experts widens the shared MLP; first_k_dense_replace past the last layer leaves no MoE layer.
    cfg = preset_config("tiny-glm4-moe")
    cfg.n_shared_experts = 2
    assert model_spec(cfg).shared_expert_intermediate_size == 64
    cfg.first_k_dense_replace = 9
    with pytest.raises(ValueError, match="every layer is dense"):
        model_spec(cfg)


@pytest.mark.unit
def test_glm4_moe_declarations_resolve_to_the_checkpoint_names():
    spec = model_spec(preset_config("tiny-glm4-moe"))
    conv = get_converter("glm4_moe")
    names = {
        "decoder.layers.1.mlp.router.weight": ("model.layers.1.mlp.gate.weight",),
        "decoder.layers.1.mlp.router.expert_bias": ("model.layers.1.mlp.gate.e_score_correction_bias",),
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight": (
            "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"),
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": (
            "model.layers.1.mlp.shared_experts.down_proj.weight",),
        "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight": (
            "model.layers.2.mlp.experts.5.down_proj.weight",),
        "decoder.layers.0.mlp.linear_fc1.weight": ("model.layers.0.mlp.gate_proj.weight",
                                                   "model.layers.0.mlp.up_proj.weight"),
        "decoder.layers.0.self_attention.linear_qkv.bias": ("model.layers.0.self_attn.q_proj.bias",
                                                            "model.layers.0.self_attn.k_proj.bias",
                                                            "model.layers.0.self_attn.v_proj.bias"),
        "decoder.layers.0.self_attention.k_layernorm.weight": ("model.layers.0.self_attn.k_norm.weight",),
    }
    for megatron, hf in names.items():
        assert conv.resolve(megatron, spec).hf_names == hf, megatron
    shared = conv.resolve("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", spec).mapping
    assert (shared.tp_dim, shared.tp_group) == (0, "tp")  # dense TP, not expert-TP
    assert conv.resolve("decoder.layers.1.mlp.shared_experts.gate_weight", spec) is None  # no gate in GLM-4.5
    # Multi-token prediction layers: refused, with the reason, rather than streamed without them.
    mtp = conv.resolve("mtp.layers.0.eh_proj.weight", spec)
    with pytest.raises(NotRepresentable, match="multi-token-prediction layers are not streamed"):
        mtp.mapping.op.to_hf(torch.zeros(4, 4), OpContext(spec))


def test_glm4_moe_expected_names_are_what_save_pretrained_writes(tmp_path):
    """The HF side of key coverage: the names the family declares from transformers' in-memory model (fused
    experts one name per expert, the score-correction bias buffer) are exactly what ``save_pretrained`` writes;
    and the block-FP8 declaration quantizes every projection, never the router, its bias or a norm."""
    for key, cfg in (("glm", preset_config("tiny-glm4-moe")), ("air", _air_like())):
        out = _save_moe(cfg, tmp_path / key, 1)
        with CheckpointReader(out) as reader:
            saved = {n: tuple(reader.get(n).shape) for n in reader.keys()}
        assert expected_hf_shapes(cfg) == saved
        assert not any(".mlp.gate." in n for n in saved if n.startswith("model.layers.0."))  # layer 0 dense
    conv = get_converter("glm4_moe")
    fp8 = sorted(n for n in saved if conv.quantizes(n))
    assert all(n.endswith("_proj.weight") for n in fp8)
    assert len(fp8) == 4 * 4 + 3 + 3 * (3 + 3 * 8)  # attention x 4 layers, dense MLP, (shared + 8 experts) x 3
    assert conv.not_quantized({n: s for n, s in saved.items() if n.startswith("model.layers.1.")}) == [
        "model.layers.1.mlp.gate"]


def test_glm4_moe_routing_megatron_cannot_compute_is_refused_listing_every_problem():
    """Megatron-Core renormalises the chosen sigmoid scores always, and ranks groups by their best top_k /
    group_top_k scores (HF by their best 2): configs it would route otherwise are refused, each problem named.
    ModelSpec refuses inconsistent routing on its own."""
    from weightstream.checks.megatron_models import transformer_config

    cfg = preset_config("tiny-glm4-moe")
    cfg.norm_topk_prob, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group = False, 4, 4, 1
    with pytest.raises(ConversionError) as err:
        transformer_config(model_spec(cfg))
    text = str(err.value)
    assert "sigmoid scores without norm_topk_prob" in text and "4 // 1 scores in Megatron" in text
    cfg = preset_config("tiny-glm4-moe")
    cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.rope_parameters = 3, 4, 0.0, {
        **cfg.rope_parameters, "partial_rotary_factor": 0.3}
    with pytest.raises(ValueError) as err:
        model_spec(cfg)
    text = str(err.value)
    for problem in ("not a multiple of moe_num_groups (3)", "moe_routed_scaling_factor must be positive",
                    "partial_rotary_factor=0.3"):
        assert problem in text


def test_glm45_air_shapes_and_plan():
    """GLM-4.5-Air's real shapes (random weights for ``weightstream bench``): 17,925 HF tensors, 106.85 B
    parameters, 213.7 GB in bf16 (the score-correction biases in float32); 512 MiB buckets hold every tensor
    but the embedding and lm_head (1.24 GB each, alone), 408 buckets in all."""
    shapes = expected_hf_shapes(preset_config("glm-4.5-air"))
    assert len(shapes) == 45 * (7 + 2 + 2 + 3 + 3 * 128) + (7 + 2 + 3) + 3 == 17925  # MoE layers, layer 0, ends
    assert sum(math.prod(s) for s in shapes.values()) == 106_852_251_264
    assert shapes["model.layers.1.mlp.experts.127.gate_proj.weight"] == (1408, 4096)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (96 * 128, 4096)
    assert "model.layers.46.eh_proj.weight" not in shapes  # the MTP layer: not in transformers' model
    outputs = [[math.prod(s) * (4 if n.endswith("e_score_correction_bias") else 2)] for n, s in shapes.items()]
    plan = plan_buckets(outputs, 512 << 20, ALIGN)
    oversize = [bp for bp in plan if bp.nbytes > 512 << 20]
    assert [(len(bp.items), bp.nbytes) for bp in oversize] == [(1, 151552 * 4096 * 2)] * 2
    assert len(plan) == 408


# -- DeepSeek-V3 -------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_deepseek_v3_spec_and_declarations():
    spec = model_spec(preset_config(LORA))
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim) == (
        24, 16, 8, 4, 8)
    assert spec.dense_layers == frozenset({0, 1}) and spec.num_experts == DEEPSEEK_V3.experts
    assert (spec.moe_score_function, spec.moe_expert_bias, spec.moe_num_groups, spec.moe_group_top_k) == (
        "sigmoid", True, 4, 2)
    assert spec.moe_routed_scaling_factor == 2.5 and spec.shared_expert_intermediate_size == 32
    assert spec.yarn is not None and (spec.yarn.factor, spec.yarn.mscale, spec.yarn.mscale_all_dim) == (4.0, 0.8, 1.0)
    q_proj = model_spec(preset_config(QPROJ))
    assert q_proj.q_lora_rank is None and q_proj.yarn is None and q_proj.shared_expert_intermediate_size == 64
    # Block FP8 as the published DeepSeek-V3 FP8 checkpoint: every projection of attention and the MLPs; the
    # embeddings, output layer, routers (and their bias), norms stay.
    conv = get_converter("deepseek_v3")
    names = {"model.layers.0.self_attn.q_a_proj.weight": True, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight":
             True, "model.layers.1.self_attn.q_proj.weight": True, "model.layers.0.self_attn.kv_b_proj.weight": True,
             "model.layers.2.mlp.shared_experts.down_proj.weight": True, "model.layers.2.mlp.experts.7.up_proj.weight":
             True, "model.layers.0.mlp.gate_proj.weight": True, "model.layers.2.mlp.gate.weight": False,
             "model.layers.2.mlp.gate.e_score_correction_bias": False,
             "model.layers.0.self_attn.kv_a_layernorm.weight": False, "model.embed_tokens.weight": False,
             "lm_head.weight": False}
    assert {n: conv.quantizes(n) for n in names} == names


def test_deepseek_v3_multi_token_prediction_layers_on_one_side_only_are_refused(jobs):
    """MTP layers the model has but the config does not declare, and the reverse: refused, each tensor named."""
    results = jobs.job(DEEPSEEK_V3)["cases"]
    assert len(results["mtp not in config"]) == len(results["mtp not in model"]) == 2
    for r in results["mtp not in config"]:
        refused = r["problems"]["Megatron tensors the HF model has no place for"]
        # Its own 4, the attention's 8 and pre-MLP norm, the router's 2, 8 experts' and the shared experts' fc1/fc2.
        assert len(refused) == 4 + 9 + 2 + 16 + 2 and all(x.startswith("mtp.layers.0.") for x in refused)
        assert "num_nextn_predict_layers = 0" in refused[0]
    for r in results["mtp not in model"]:
        missing = r["problems"]["HF tensors the model does not provide"]
        # Every tensor of layer 4 but the embedding and output-layer copies (made from the model's own).
        assert len(missing) == 44 - 2 and all(x.startswith("model.layers.4.") for x in missing)


def test_deepseek_v3_transformer_engine_names_hold_whole_down_projections(jobs):
    """Transformer Engine's spec: latent norms fused into the up projections, down projections whole on both TP
    ranks; loaded into those names and streamed, bit for bit (the stream checked by the table's te reload runs)."""
    results = jobs.job(DEEPSEEK_V3)["cases"]
    for f in (LORA, QPROJ):
        for r in results[f"tp2 te reload {f}"]:
            assert r["kv_down_shape"] == (16 + 4, 64)
            assert "linear_kv_up_proj.layer_norm_weight" in r["te_names"]
            assert ("linear_q_up_proj.layer_norm_weight" in r["te_names"]) == (f == LORA)


def test_deepseek_v3_671b_shapes_and_plan():
    """DeepSeek-V3's real shapes (random weights for ``weightstream bench``): 46,183 HF tensors with its MTP layer
    (model.layers.61), 684.5 B parameters (671.0 B without it), 1.37 TB in bf16 (the score-correction biases in
    float32); 512 MiB buckets hold every tensor but the embedding, lm_head and their MTP copies (1.85 GB each,
    alone): 2,589 buckets. Block FP8 quantizes 45,808 of them (680.6 B parameters)."""
    cfg = preset_config("deepseek-v3")
    shapes = expected_hf_shapes(cfg)
    moe_layer, dense_layer = 7 + 2 + 2 + 3 + 3 * 256, 7 + 2 + 3  # attention, norms, router, shared, experts
    assert len(shapes) == 58 * moe_layer + 3 * dense_layer + (moe_layer + 6) + 3 == 46183
    assert sum(math.prod(s) for s in shapes.values()) == 684_489_845_504
    assert sum(math.prod(s) for n, s in shapes.items() if not n.startswith("model.layers.61.")) == 671_026_419_200
    assert shapes["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert shapes["model.layers.3.self_attn.q_b_proj.weight"] == (128 * (128 + 64), 1536)
    assert shapes["model.layers.3.self_attn.kv_b_proj.weight"] == (128 * (128 + 128), 512)
    assert shapes["model.layers.61.eh_proj.weight"] == (7168, 2 * 7168)
    assert shapes["model.layers.61.mlp.experts.255.down_proj.weight"] == (7168, 2048)
    outputs = [[math.prod(s) * (4 if n.endswith("e_score_correction_bias") else 2)] for n, s in shapes.items()]
    assert sum(o[0] for o in outputs) == 1_368_979_721_216
    plan = plan_buckets(outputs, 512 << 20, ALIGN)
    assert [(len(bp.items), bp.nbytes) for bp in plan if bp.nbytes > 512 << 20] == [(1, 129280 * 7168 * 2)] * 4
    assert len(plan) == 2589
    conv = get_converter("deepseek_v3")
    fp8 = [n for n in shapes if conv.quantizes(n)]
    assert len(fp8) == 45808 and sum(math.prod(shapes[n]) for n in fp8) == 680_571_043_840
