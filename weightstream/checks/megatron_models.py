"""Megatron-Core models built on the CPU for an HF config, HF checkpoints loaded into them, and their logits.

The loader is the inverse of the stream: the same converter declarations, each op's
``to_megatron``, then this rank's TP shard. It is what ``weightstream demo``, ``example``, ``dump``, ``bench``
and the tests use to put known weights into a Megatron model under any layout, and to compare its logits with
the HF model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from collections.abc import Mapping as MappingABC
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from weightstream.converters.mapping import Converter, Resolved
from weightstream.converters.ops import NotRepresentable, OpContext
from weightstream.converters.registry import get_converter, model_spec
from weightstream.errors import ProblemList
from weightstream.models.spec import ModelSpec, load_hf_config
from weightstream.sources.megatron import LocalTensor, local_tensors
from weightstream.sources.topology import Topology

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


__all__ = [
    "initialize_parallel", "padded_vocab_size", "transformer_config", "MLACoreAttention", "build_gpt_model",
    "load_hf_weights", "forward_shims", "megatron_logits"
]


def initialize_parallel(
    tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, etp: int | None = None, *, seed: int = 1234
) -> None:
    """``parallel_state.initialize_model_parallel`` for an already initialised ``torch.distributed``."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=torch.cuda.is_available(),
    )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    multiple = divisible_by * tp
    return (vocab_size + multiple - 1) // multiple * multiple


def transformer_config(spec: ModelSpec, *, dtype: torch.dtype = torch.float32, sequence_parallel: bool = False):
    """A ``TransformerConfig`` matching ``spec`` under the current parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    router = _router_config(spec) if spec.is_moe else {}  # refuses routing Megatron computes otherwise, first
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size or spec.moe_intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        pipeline_dtype=dtype,
        sequence_parallel=sequence_parallel,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if spec.is_moe:
        kwargs.update(
            num_moe_experts=spec.num_experts,
            moe_ffn_hidden_size=spec.moe_intermediate_size,
            moe_router_topk=spec.moe_top_k,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
            moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size or None,
            moe_shared_expert_gate=spec.shared_expert_gate,
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
            moe_layer_freq=[0 if layer in spec.dense_layers else 1 for layer in range(spec.num_layers)],
            **router,
        )
    if spec.is_mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**{**kwargs, **_mla_config(spec)})
    return TransformerConfig(**kwargs)


def _mla_config(spec: ModelSpec) -> dict[str, Any]:
    """Megatron-Core's multi-latent attention settings for ``spec`` (``MLATransformerConfig``). Megatron takes
    the rotary dimensions of q and k in DeepSeek's interleaved pairs itself (``multi_latent_attention``), as HF's
    ``rope_interleave`` does; YaRN's factor, bounds and mscales carry over as they are."""
    out: dict[str, Any] = dict(
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_head_dim=spec.qk_nope_head_dim,
        qk_pos_emb_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        kv_channels=spec.qk_nope_head_dim + spec.qk_rope_head_dim,
        qk_layernorm=True,  # q_a_layernorm, kv_a_layernorm
        rotary_base=spec.rope_theta,
        rope_type="rope",
        mtp_num_layers=spec.mtp_layers or None,
    )
    if spec.yarn is not None:
        out.update(rope_type="yarn", rotary_scaling_factor=spec.yarn.factor,
                   original_max_position_embeddings=spec.yarn.original_max_position_embeddings,
                   beta_fast=spec.yarn.beta_fast, beta_slow=spec.yarn.beta_slow, mscale=spec.yarn.mscale,
                   mscale_all_dim=spec.yarn.mscale_all_dim)
    return out


def _router_config(spec: ModelSpec) -> dict[str, Any]:
    """Megatron-Core's router settings for the HF routing ``spec`` declares; routing Megatron computes otherwise
    (so the trained model would not be the HF one) raises, every problem listed."""
    problems = ProblemList()
    sigmoid = spec.moe_score_function == "sigmoid"
    if sigmoid and spec.moe_top_k > 1 and not spec.norm_topk_prob:
        problems.add("routing Megatron-Core computes otherwise",
                     "sigmoid scores without norm_topk_prob: Megatron always renormalises the chosen experts' "
                     "sigmoid scores (top-k > 1)")
    grouped = 0 < spec.moe_group_top_k < spec.moe_num_groups
    if grouped and spec.moe_top_k // spec.moe_group_top_k != 2:
        problems.add("routing Megatron-Core computes otherwise",
                     f"grouped top-k ranks each group by its best top_k / group_top_k = {spec.moe_top_k} // "
                     f"{spec.moe_group_top_k} scores in Megatron, by its best 2 in Hugging Face")
    if grouped and not sigmoid and spec.norm_topk_prob:
        problems.add("routing Megatron-Core computes otherwise",
                     "grouped top-k over softmax scores with norm_topk_prob: Megatron would rank the groups by "
                     "logits, not probabilities")
    problems.raise_if_any(f"cannot build a Megatron-Core model routing as this {spec.model_type} config does")
    return dict(
        moe_router_score_function=spec.moe_score_function,
        # Softmax over every expert before the top-k (Qwen2-MoE), or over the chosen ones (norm_topk_prob);
        # sigmoid scores do not read it.
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_enable_expert_bias=spec.moe_expert_bias,
        moe_router_num_groups=spec.moe_num_groups if grouped else None,
        moe_router_group_topk=spec.moe_group_top_k if grouped else None,
        moe_router_topk_scaling_factor=(spec.moe_routed_scaling_factor if spec.moe_routed_scaling_factor != 1.0
                                        else None),
    )


@contextlib.contextmanager
def _cpu_build_shims() -> Iterator[None]:
    """Tied embeddings with PP > 1 call ``.cuda()`` on the shared weight while building; the router's expert bias
    (``moe_router_enable_expert_bias``) and multi-latent attention's rotary embedding are built on
    ``torch.cuda.current_device()``."""
    if torch.cuda.is_available():
        yield
        return
    original, device = torch.Tensor.cuda, torch.cuda.current_device
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]
        torch.cuda.current_device = device


@contextlib.contextmanager
def _mla_without_te() -> Iterator[None]:
    """Without Transformer Engine, Megatron-Core 0.16's multi-latent attention still believes it has it (its
    ``TELinear`` is a placeholder that ``isinstance`` refuses): told otherwise while it is built."""
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.HAVE_TE and isinstance(mla.TELinear, type):
        yield
        return
    mla.HAVE_TE = False
    try:
        yield
    finally:
        mla.HAVE_TE = True


def _stage_specs(config, spec: ModelSpec, layer_spec, vp_stage: int | None):
    """The layer specs of one (virtual) pipeline stage, and its multi-token prediction block's (or None).

    One layer spec serves every layer of a dense model; an MoE model with dense layers (moe_layer_freq) needs the
    block spec, which picks a dense or MoE spec layer by layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    stage_spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                             vp_stage=vp_stage) if spec.is_moe else layer_spec)
    if not spec.is_mla:
        return stage_spec, None
    return _mla_specs(config, stage_spec, vp_stage)


def _mla_specs(config, stage_spec, vp_stage: int | None):
    """The stage's layer specs with a core attention that takes what multi-latent attention passes (Megatron-Core
    0.16's local ``DotProductAttention`` refuses its ``k_channels``/``v_channels``), and the spec of the
    multi-token prediction block where this stage holds it (None elsewhere, or without MTP layers)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer_specs = stage_spec.layer_specs if isinstance(stage_spec, TransformerBlockSubmodules) else [stage_spec]
    for layer in layer_specs:
        layer.submodules.self_attention.submodules.core_attention = MLACoreAttention
    mtp = None
    if config.mtp_num_layers:
        mtp = get_gpt_mtp_block_spec(config, stage_spec, use_transformer_engine=False, vp_stage=vp_stage)
    return stage_spec, mtp


class MLACoreAttention(nn.Module):
    """Softmax attention over Megatron's ``[seq, batch, heads, dim]`` query/key/value, with the softmax scale and
    head dimensions multi-latent attention gives (keys of ``k_channels``, values of ``v_channels``); a mask
    of True where a query may not look. Holds no weights: test support for building MLA on the CPU."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 softmax_scale: float | None = None, k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, attention_dropout: float | None = None):
        super().__init__()
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or 1) ** -0.5

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Tensor:
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [batch, heads, seq, dim]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # [batch, heads, seq, v_dim]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _rope_scaling(spec: ModelSpec) -> dict[str, Any]:
    """``GPTModel``'s rotary scaling for ``spec``: Llama 3's (``rope_scaling``, ``rope_scaling_factor``; Megatron-Core
    0.16 fixes its other parameters at Llama 3.1's: low/high frequency factors 1 and 4, 8,192 original positions);
    a rotary embedding Megatron computes otherwise than HF raises, every problem listed (YaRN is multi-latent
    attention's, built from its config)."""
    problems = ProblemList()
    rope = spec.llama3_rope
    if rope is not None and (rope.low_freq_factor, rope.high_freq_factor,
                             rope.original_max_position_embeddings) != (1.0, 4.0, 8192):
        problems.add("rotary embeddings Megatron-Core computes otherwise",
                     f"llama3 scaling with low_freq_factor={rope.low_freq_factor}, high_freq_factor="
                     f"{rope.high_freq_factor}, original_max_position_embeddings="
                     f"{rope.original_max_position_embeddings}: Megatron-Core 0.16 fixes them at 1, 4 and 8192")
    if spec.rope_type not in ("default", "llama3") and not (spec.rope_type == "yarn" and spec.is_mla):
        problems.add("rotary embeddings Megatron-Core computes otherwise",
                     f"rope_type {spec.rope_type!r} (built here: default, llama3, yarn with multi-latent attention)")
    problems.raise_if_any(f"cannot build a Megatron-Core model for this {spec.model_type} config")
    return {"rope_scaling": True, "rope_scaling_factor": rope.factor} if rope is not None else {}


def build_gpt_model(
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_divisible_by: int = 128,
    sequence_parallel: bool = False,
) -> list[nn.Module]:
    """Megatron-Core ``GPTModel`` chunks (one per virtual pipeline stage) for ``hf_config`` under the
    current ``parallel_state``, built with the local (no Transformer Engine) layer spec; MoE layers
    hold SequentialMLP experts, split over EP (and expert-TP) as ``parallel_state`` says.

    MoE with TP > 1 needs ``sequence_parallel=True`` to run in training mode; evaluation (what
    :func:`megatron_logits` does) runs without it."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = model_spec(hf_config)
    config = transformer_config(spec, dtype=dtype, sequence_parallel=sequence_parallel)
    layer_spec = get_gpt_layer_local_spec(
        num_experts=spec.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=spec.qk_norm or spec.is_mla,
        multi_latent_attention=spec.is_mla,
        normalization="RMSNorm",
    )
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    vocab = padded_vocab_size(spec.vocab_size, ps.get_tensor_model_parallel_world_size(), vocab_divisible_by)
    chunks = []
    with _cpu_build_shims(), _mla_without_te():
        for stage in range(vpp):
            vp_stage = stage if vpp > 1 else None
            stage_spec, mtp_spec = _stage_specs(config, spec, layer_spec, vp_stage)
            model = GPTModel(
                config=config,
                transformer_layer_spec=stage_spec,
                vocab_size=vocab,
                max_sequence_length=spec.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=spec.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_percent=spec.partial_rotary_factor,
                rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
                vp_stage=vp_stage,
                mtp_block_spec=mtp_spec,
                **_rope_scaling(spec),
            )
            if dtype != torch.float32:
                # What Megatron's Float16Module does: every parameter in the training dtype (the
                # local spec builds its norms in float32).
                model = model.to(dtype)
                _float32_expert_bias(model)
            if torch.cuda.is_available():
                model = model.cuda()
            chunks.append(model)
    return chunks


def _float32_expert_bias(model: nn.Module) -> None:
    """The routers' expert bias back in float32, where Megatron keeps it whatever the training dtype (as HF keeps
    ``e_score_correction_bias``)."""
    for name, buffer in list(model.named_buffers()):
        if name.endswith("router.expert_bias"):
            model.get_submodule(name.rpartition(".")[0]).expert_bias = buffer.float()


def load_hf_weights(
    model_chunks: nn.Module | Sequence[nn.Module],
    hf_config: Any,
    weights: MappingABC[str, Tensor] | Any,
    *,
    topology: Topology | None = None,
) -> None:
    """Copy HF weights into a Megatron model (every rank calls it, each filling its own shards).

    ``weights``: a mapping name -> tensor, or anything with ``get(name)`` and ``keys()`` such as
    :class:`weightstream.common.hf_files.CheckpointReader`. Every problem (a parameter no mapping covers,
    missing HF tensors, shape mismatches, HF tensors no parameter took) is raised as one error.
    """
    topo = topology or Topology.current()
    cfg = load_hf_config(hf_config)
    spec = model_spec(cfg)
    converter = get_converter(spec.model_type)
    problems = ProblemList()
    available = set(weights.keys())
    used: set[str] = set()
    with torch.no_grad():
        for local in local_tensors(model_chunks, topo, spec.num_experts):
            used.update(_load_tensor(local, converter, spec, weights, available, topo, problems))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        used, problems = _merged_over_ranks(used, problems)
    for name in sorted(available - used):
        problems.add("HF tensors no Megatron parameter took", name)
    problems.raise_if_any(f"cannot load this {spec.model_type} checkpoint into the Megatron model")


def _load_tensor(local: LocalTensor, converter: Converter, spec: ModelSpec, weights: MappingABC[str, Tensor] | Any,
                 available: set[str], topo: Topology, problems: ProblemList) -> tuple[str, ...]:
    """Fill one tensor of this rank with its shard of what its mapping makes of the HF tensors; the HF names
    it took (none when there is a problem, added to ``problems``)."""
    resolved = converter.resolve(local.name, spec)
    if resolved is None:
        problems.add("Megatron tensors no mapping covers", local.name)
        return ()
    missing = [n for n in resolved.hf_names if n not in available]
    if missing:
        for n in missing:
            problems.add("HF tensors missing from the checkpoint", f"{n} (for {local.name})")
        return ()
    mapping = resolved.mapping
    hf = [weights[n] if isinstance(weights, MappingABC) else weights.get(n) for n in resolved.hf_names]
    tp_dim = mapping.tp_dim
    if mapping.whole_or_split and all(tuple(t.shape) == tuple(local.tensor.shape) for t in hf):
        tp_dim = None  # held whole on every rank (Transformer Engine's spec)
    parts_n = topo.group_size(mapping.tp_group) if tp_dim is not None else 1
    rank = topo.group_rank(mapping.tp_group) if tp_dim is not None else 0
    full_shape = list(local.tensor.shape)
    if tp_dim is not None and parts_n > 1:
        full_shape[tp_dim] *= parts_n
    full = _megatron_tensor(local.name, resolved, hf, OpContext(spec, parts=parts_n), full_shape, problems)
    if full is None:
        return ()
    shard = full
    if tp_dim is not None and parts_n > 1:
        length = local.tensor.shape[tp_dim]
        shard = full.narrow(tp_dim, rank * length, length)
    local.tensor.copy_(shard)
    return resolved.hf_names


def _megatron_tensor(name: str, resolved: Resolved, hf: list[Tensor], ctx: OpContext, full_shape: list[int],
                     problems: ProblemList) -> Tensor | None:
    """The whole Megatron tensor ``name`` (of ``full_shape``) that the mapping makes of the HF tensors ``hf``;
    None when it cannot (a problem added)."""
    try:
        full = resolved.mapping.op.to_megatron(hf, ctx, torch.Size(full_shape))
    except NotRepresentable as exc:
        problems.add("Megatron tensors the HF model has no place for", f"{name}: {exc}")
        return None
    except (ValueError, RuntimeError) as exc:
        problems.add("shape mismatches", f"{name} from {list(resolved.hf_names)}: {exc}")
        return None
    if list(full.shape) != full_shape:
        problems.add(
            "shape mismatches",
            f"{name}: model has {tuple(full_shape)}, checkpoint gives {tuple(full.shape)}",
        )
        return None
    return full


def _merged_over_ranks(used: set[str], problems: ProblemList) -> tuple[set[str], ProblemList]:
    """The HF names every rank took and the problems every rank found (each once, in rank order)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(used), problems._problems))
    used = set().union(*(set(u) for u, _ in everyone))
    merged = ProblemList()
    for _, p in everyone:
        for kind, items in p.items():
            for item in items:
                if item not in merged._problems.get(kind, []):
                    merged.add(kind, item)
    return used, merged


@contextlib.contextmanager
def forward_shims() -> Iterator[None]:
    """What Megatron-Core 0.16's forward needs where parts of its usual stack are missing: without Transformer
    Engine (on any device) the MoE router's GEMM name is unbound (``te_general_gemm``: a NameError; Megatron
    falls back to torch when it is None); without CUDA, a current device for rotary embeddings and a no-op
    CUDA RNG tracker fork."""
    with _moe_router_without_te():
        if torch.cuda.is_available():
            yield
            return
        from megatron.core.tensor_parallel import random as mrandom

        tracker = mrandom.get_cuda_rng_tracker()
        saved_device = torch.cuda.current_device
        saved_fork = tracker.fork
        # A patch, against torch's declared int: Megatron's rotary embeddings take the device it names.
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
        tracker.fork = lambda *a, **k: contextlib.nullcontext()
        try:
            yield
        finally:
            torch.cuda.current_device = saved_device
            tracker.fork = saved_fork


@contextlib.contextmanager
def _without_mtp(chunks: Sequence[GPTModel]) -> Iterator[None]:
    """The main model's forward only: Megatron-Core 0.16 runs its multi-token prediction layers in every forward
    and then needs labels (it returns their loss); left out while the chunks compute logits."""
    saved = [(c, c.config.mtp_num_layers, c.mtp_process) for c in chunks if c.config.mtp_num_layers]
    for chunk, _, _ in saved:
        chunk.config.mtp_num_layers, chunk.mtp_process = None, False
    try:
        yield
    finally:
        for chunk, layers, process in saved:
            chunk.config.mtp_num_layers, chunk.mtp_process = layers, process


@contextlib.contextmanager
def _moe_router_without_te() -> Iterator[None]:
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE or "te_general_gemm" in vars(moe_utils):  # Transformer Engine's, or set by an outer call
        yield
        return
    moe_utils.te_general_gemm = None  # what Megatron checks before using Transformer Engine's GEMM
    try:
        yield
    finally:
        del moe_utils.te_general_gemm


def megatron_logits(model_chunks: nn.Module | Sequence[nn.Module], input_ids: Tensor, vocab_size: int) -> Tensor:
    """Full-vocabulary logits ``(batch, seq, vocab_size)`` of a Megatron GPT model, on every rank.

    Runs the pipeline by hand (stage by stage, chunk by chunk, hidden states passed with send/recv
    over the PP group), gathers the vocab-parallel logits over TP and trims the padded vocabulary.
    """
    from megatron.core import parallel_state as ps

    from weightstream.sources.megatron import as_chunks, unwrap

    chunks: list[GPTModel] = [unwrap(c) for c in as_chunks(model_chunks)]
    topo = Topology.current()
    batch, seq = input_ids.shape
    device = next(chunks[0].parameters()).device
    input_ids = input_ids.to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
    hidden_size = chunks[0].config.hidden_size
    dtype = chunks[0].config.params_dtype
    output = None
    with torch.no_grad(), forward_shims(), _without_mtp(chunks):
        for v, chunk in enumerate(chunks):
            was_training = chunk.training
            chunk.eval()
            for stage in range(topo.pp_size):
                if stage != topo.pp_rank:
                    continue
                first = v == 0 and stage == 0
                hidden = None
                if not first:
                    hidden = torch.empty(seq, batch, hidden_size, dtype=dtype, device=device)
                    prev = stage - 1 if stage > 0 else topo.pp_size - 1
                    dist.recv(hidden, group=topo.pp_group, group_src=prev)
                    chunk.set_input_tensor(hidden)
                out = chunk(input_ids if first else None, position_ids, mask)
                last = v == len(chunks) - 1 and stage == topo.pp_size - 1
                if last:
                    output = out
                else:
                    nxt = stage + 1 if stage + 1 < topo.pp_size else 0
                    dist.send(out.contiguous(), group=topo.pp_group, group_dst=nxt)
            chunk.train(was_training)
    # The last stage holds the vocab-parallel logits: gather over TP, trim, share over PP.
    vocab_local = torch.zeros(1, dtype=torch.long)
    if output is not None:
        vocab_local[0] = output.shape[-1]
    if topo.pp_size > 1:
        dist.broadcast(vocab_local, group=topo.pp_group, group_src=topo.pp_size - 1)
    if output is None:
        output = torch.empty(batch, seq, int(vocab_local[0]), dtype=dtype, device=device)
    if topo.pp_size > 1:
        output = output.contiguous()
        dist.broadcast(output, group=topo.pp_group, group_src=topo.pp_size - 1)
    if topo.tp_size > 1:
        parts = [torch.empty_like(output) for _ in range(topo.tp_size)]
        dist.all_gather(parts, output.contiguous(), group=ps.get_tensor_model_parallel_group())
        output = torch.cat(parts, dim=-1)
    return output[..., :vocab_size].float()
