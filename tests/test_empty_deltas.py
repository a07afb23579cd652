"""Delta updates in which most buckets have no changed word (a frozen layer's, the common case), over IPC on the CPU
into a real reference engine: every update after the first goes as deltas, the empty ones included, and the engine
then holds the trainer's tensors bit for bit, with the transfer's checksums on and off and direct writes allowed
or not."""

from __future__ import annotations

import pytest
import torch

from tests.test_delta_updates import assert_engine_holds, engine
from weightstream import WeightSync
from weightstream.models.presets import preset_config, random_hf_model, save_random_checkpoint

SMALL = 120_000  # bytes per bucket: the tiny model travels in several buckets
CHANGED = 8  # words changed between two updates, all in one tensor


class FewWordsTrainer:
    """A bf16 transformers model whose every step changes :data:`CHANGED` words of one tensor (each step
    another): every other bucket of the update has nothing to send."""

    def __init__(self, seed: int):
        self.config = preset_config("tiny-qwen3")
        self.model = random_hf_model(self.config, seed=seed, dtype=torch.bfloat16)
        self.names = [n for n, _ in self.model.named_parameters()]

    def step(self, step: int) -> None:
        param = dict(self.model.named_parameters())[self.names[(7 * step) % len(self.names)]]
        with torch.no_grad():
            words = param.view(-1).view(torch.int16)
            words[:CHANGED] ^= 1  # the lowest mantissa bit: a changed word, still a finite number

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    return save_random_checkpoint(preset_config("tiny-qwen3"), tmp_path_factory.mktemp("empty") / "m", seed=321)


@pytest.mark.parametrize("checksums,direct", [(False, True), (True, True), (False, False), (True, False)])
def test_ipc_delta_updates_with_empty_buckets(engine_dir, checksums, direct):
    trainer = FewWordsTrainer(seed=8)
    with engine(engine_dir) as server, WeightSync([server.url], transport="ipc", bucket_bytes=SMALL, delta=True,
                                                  checksums=checksums, direct=direct) as sync:
        first = sync.update(trainer.model, trainer.config, weight_version="v0")
        assert first.transport == "ipc" and first.delta.full and first.delta.checked
        assert first.buckets > 3
        assert_engine_holds(server, trainer)
        for step in range(1, 6):
            trainer.step(step)
            report = sync.update(trainer.model, trainer.config, weight_version=f"v{step}")
            d = report.delta
            assert (d.full, d.checked, d.mismatch) == (False, True, None), report.summary()
            assert d.reason == f"deltas against version v{step - 1}"
            assert d.words * 2 == d.snapshot_bytes >= report.bytes  # every word of every bucket compared
            counts = [h.count for h in sync.delta.snapshot.headers.values()]
            assert len(counts) == report.buckets and 0 in counts, counts
            # the bytes between tensors are zero in every pack (kept buffers included): only the changed words count
            assert d.changed == CHANGED and counts.count(0) == report.buckets - 1, counts
            assert d.wire_bytes == CHANGED * (4 + 2)  # positions and values of the changed words, nothing else
            assert server.engine.weight_version == f"v{step}"
            assert_engine_holds(server, trainer)
