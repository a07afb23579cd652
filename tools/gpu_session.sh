#!/usr/bin/env bash
# One device call: correctness check, then the benchmark rows given as "preset:transport[:flags]" words.
#   bash tools/gpu_session.sh check qwen3-8b:ipc qwen3-8b:ipc:--no-rollback qwen3-30b-a3b:stream:--reuse-buffers
# Block FP8 (flags are one word, so quote them): qwen3-8b:stream:"--reuse-buffers --quantize fp8-block",
#   qwen3-8b:ipc:"--quantize fp8-block", qwen3-30b-a3b:ipc:"--no-rollback --quantize fp8-block" (H200: the 30B trainer
#   and its engine on one GPU); the same rows without --quantize for the bf16 update they are compared with.
# On two GPUs (nvidia-h200-x2; lent for two calls on 2026-11-24, before the trainer stopped waiting on the host per
#   bucket, the engine kept its copies out of its receive buffers and prepare() warmed the group: run these again):
#   ROW_TIMEOUT=160 ... qwen3-8b:broadcast:--prepare qwen3-8b:p2p:--prepare (and each with "--prepare --quantize
#   fp8-block"); ROW_TIMEOUT=200 ... qwen3-30b-a3b:broadcast:--prepare qwen3-30b-a3b:broadcast:"--prepare --quantize
#   fp8-block". The same rows by wire, bf16 then FP8, whose bytes halve (issue 19's
#   ratio to raw of the FP8 bytes against the bf16 row's), and the engine's side of each (its phases print too):
#   qwen3-8b:broadcast qwen3-8b:broadcast:"--quantize fp8-block" qwen3-8b:p2p qwen3-8b:p2p:"--quantize fp8-block"
#   qwen3-30b-a3b:broadcast qwen3-30b-a3b:broadcast:"--quantize fp8-block" qwen3-30b-a3b:broadcast:--prepare
# Several engines by P2P from the trainer's replicas against one broadcast (nvidia-h200-x4: two trainer replicas on
#   GPUs 0-1, two engines on GPUs 2-3): qwen3-8b:p2p:"--replicas 2" qwen3-8b:broadcast:"--replicas 2".
# Delta updates on real Adam steps (issue 22's goal row, two GPUs): bash tools/gpu_run.sh bench --delta --transport
#   broadcast --preset qwen3-4b --lr 1e-6,1e-5 --steps 3 (one GPU: --transport ipc; qwen3-8b needs --masters host,
#   whose Adam steps over 8 B fp32 masters on the host outran a 185 s row bound on the H200 x2: give it 400 s alone).
#   On 80 GB cards Adam's states on the device ran out of memory for qwen3-4b: keep them on the host, each parameter
#   stepped on the device in turn (--optimizer-on-host; qwen3-8b with --masters host too, its masters brought over
#   per parameter as well): qwen3-4b:broadcast:"--delta --optimizer-on-host --lr 1e-6,1e-5 --steps 3".
# A wire like a link between two nodes, on one host (nvidia-h100-x2): NCCL's socket transport over loopback for every
#   process of the row (--wire socket: no P2P, no shared memory, no InfiniBand; NCCL_SOCKET_IFNAME=lo), its ceiling a
#   plain NCCL broadcast of the same bytes over that link in the same run. Qwen3-8B full bf16, delta at lr 1e-6 and
#   block FP8, then the multi-node model against them:
#   ROW_TIMEOUT=500 ... qwen3-8b:broadcast:"--wire socket" qwen3-8b:broadcast:"--wire socket --delta --masters host
#   --optimizer-on-host --lr 1e-6 --steps 3" qwen3-8b:broadcast:"--wire socket --quantize fp8-block" wire-check
#   (H100 x2, 2026-11-27, every NCCL channel via NET/Socket: bf16 3,270.9 ms on a 4.73 GB/s link, 0.94x its plain
#   broadcast; FP8 1,886.1 ms, 0.97x its link and 0.58x bf16; delta at lr 1e-6 406.7 ms at 4.2% changed; the model
#   +6.1%, +3.6%, -2.5%; the rows 107, 114 and 244 s, all checks passed)
# The block-FP8 kernel alone (bits against the whole-tensor arithmetic, speed against a device copy): the word fp8-kernel.
# The delta word kernels (bits against the torch operations, then each step per 512 MiB bucket): the word word-kernels;
#   delta updates on real Adam steps on an 80 GB GPU: bash tools/gpu_run.sh bench --delta --transport ipc --preset
#   qwen3-1.7b --masters device --snapshot device --lr 1e-6 --steps 3 (WEIGHTSTREAM_DELTA_KERNEL=0: the torch path).
# The delta encodings against general compressors on real Adam steps (carry the nvidia-nvcomp-cu13 and
#   nvidia-libnvcomp-cu13 6.0.0.12 wheels in .whl): PYTHONPATH=/tmp/site:$PWD python3 tools/delta_encodings.py --device
#   cuda --hidden 2048 --layers 8 --steps 3 --bucket-mb 512 --host; the word kernels' launch shapes:
#   python3 tools/word_kernel_sweep.py --changed 0.05 (and 0.22).
# An 80 GB card with the engine's defaults (nvidia-h100-x2; the rollback copies go to host memory where they do not
#   fit beside the weights): ROW_TIMEOUT=330 ... check qwen3-30b-a3b:broadcast qwen3-30b-a3b:broadcast:--no-rollback
#   qwen3-8b:broadcast; block FP8 on the same card: qwen3-30b-a3b:broadcast:"--quantize fp8-block".
# The MoE rows on two GPUs after the engine's pipelined receive, one-launch checks and plans kept by key (H200 x2,
#   2026-11-28: 30B-A3B bf16 231.8 ms 1.40x, block FP8 156.7 ms 0.68x bf16; docs/benchmarks.md "2026-11-28 (later)"),
#   then with the plan made ready in prepare() (/weightstream/prepare_broadcast_ahead: not yet measured on a GPU; the
#   first update after prepare() was 4.85x and 10.3x the warm one), with the one-launch check's own check first:
#   ROW_TIMEOUT=200 ... check-values qwen3-30b-a3b:broadcast:"--prepare --no-rollback"
#   qwen3-30b-a3b:broadcast:"--prepare --no-rollback --quantize fp8-block" qwen3-8b:broadcast:--prepare
#   qwen3-8b:broadcast:"--prepare --no-rollback" qwen3-8b:broadcast:"--prepare --quantize fp8-block"
#   qwen3-8b:ipc:"--prepare --no-rollback"
# IPC written into the engine's weights by copies that check what they write (one GPU, H200: the 30B trainer and its
#   engine on one GPU; 2026-11-29: 8B 16.3 ms 2.06x, 30B-A3B 59.6 ms 2.04x, first update after prepare() 1.2x;
#   docs/benchmarks.md "2026-11-29"), a fresh Triton cache first so that the cold row is cold:
#   rm -rf ~/.triton/cache; ROW_TIMEOUT=150 ... qwen3-8b:ipc:"--prepare --no-rollback"
#   qwen3-30b-a3b:ipc:"--prepare --no-rollback" qwen3-8b:ipc:"--prepare --no-rollback --quantize fp8-block" check-values
#   check (its check_nonfinite runs NaN and an infinity through the copies' flag; give it 300 s on a fresh machine);
#   the trainer's writes call by call: PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_write_profile.py --preset qwen3-8b;
#   the piece copy's launch shapes, one launch per bucket of 512 MiB: PYTHONPATH=$PWD python3 tools/gpu_copy_sweep.py
#   --gib 4. Later on 2026-11-29 (the kept plan confirmed under the copies, 128 KiB pieces, one request per update):
#   8B 11.9 ms 1.51x (the offer answered ahead), 30B-A3B 37.3 ms 1.28x, 8B block FP8 18.9 ms (both before that);
#   docs/benchmarks.md "2026-11-29 (later)". In the evening (the request sent from the trainer's own thread,
#   offer_answer first): 8B 11.4 ms 1.46x, 30B-A3B 38.2 ms 1.30x, 8B block FP8 18.1 ms; docs/benchmarks.md
#   "2026-11-29 (evening)".
# Not run on 2026-11-29 (two GPUs not lent): the MoE broadcast rows above, now with each engine worker keeping the
#   plan by key (the 30B-A3B bf16 and block-FP8 rows, --prepare --no-rollback), Qwen3-8B broadcast (--prepare, with
#   and without --no-rollback, and --quantize fp8-block), and qwen3-4b:broadcast:"--delta --optimizer-on-host --lr
#   1e-6,1e-5 --steps 3". Ready as device calls on nvidia-h200-x2 (each within a call's 600 s), from the repo root:
#   1. ROW_TIMEOUT=200 bash tools/gpu_session.sh check-values qwen3-30b-a3b:broadcast:"--prepare --no-rollback" \
#        qwen3-30b-a3b:broadcast:"--prepare --no-rollback --quantize fp8-block"
#   2. ROW_TIMEOUT=160 bash tools/gpu_session.sh qwen3-8b:broadcast:--prepare qwen3-8b:broadcast:"--prepare --no-rollback" \
#        qwen3-8b:broadcast:"--prepare --quantize fp8-block"
#   3. ROW_TIMEOUT=500 bash tools/gpu_session.sh qwen3-4b:broadcast:"--delta --optimizer-on-host --lr 1e-6,1e-5 --steps 3"
#   4. bash tools/gpu_session.sh check   (on two GPUs it checks the broadcast into an engine on GPU 1 too)
#   Goals (issue: MoE and FP8 at the wire): broadcast <= 1.2x the wire (8B and 30B-A3B), block FP8 <= 0.6x the bf16
#   update (both), the delta rows fitting an 80 GB card.
# JSON of every row and the raw output go to $OUT (or ./gpu-out); ROW_TIMEOUT (seconds, default 400) bounds each row,
# CHECK_TIMEOUT (default 480) the word check (on a fresh H200 its IPC, nonfinite and release checks took over 300 s).
set -uo pipefail
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
for row in "$@"; do
  if [ "$row" = check ]; then
    OUT="$OUT" timeout "${CHECK_TIMEOUT:-480}" bash tools/gpu_run.sh check 2>&1 | grep -v Warning | tail -12
    continue
  fi
  if [ "$row" = check-values ]; then  # the one-launch value check against the torch path, and its time per bucket
    PYTHONPATH="/tmp/site:$PWD" timeout 240 python3 tools/gpu_check_values.py --trials 400 --json "$OUT/check_values.json" \
      | tail -4
    continue
  fi
  if [ "$row" = fp8-kernel ]; then
    PYTHONPATH="/tmp/site:$PWD" timeout 300 python3 tools/gpu_fp8_kernel.py --json "$OUT/fp8_kernel.json" | tail -12
    continue
  fi
  if [ "$row" = wire-check ]; then  # the multi-node model against every --wire socket row of this call
    PYTHONPATH="/tmp/site:$PWD" timeout 120 python3 tools/multinode_model.py --check "$OUT"/broadcast_*wiresocket*.json \
      | tee "$OUT/wire_check.md"
    continue
  fi
  if [ "$row" = word-kernels ]; then
    PYTHONPATH="$PWD" timeout 300 python3 tools/check_word_kernels.py | tail -4
    PYTHONPATH="$PWD" timeout 200 python3 tools/gpu_delta_ops.py | tee "$OUT/gpu_delta_ops.txt"
    continue
  fi
  IFS=: read -r preset transport flags <<<"$row"
  name="${transport}_${preset}${flags:+_${flags//[- ]/}}"
  echo "== $row"
  start=$(date +%s)
  timeout "${ROW_TIMEOUT:-400}" bash tools/gpu_run.sh bench --preset "$preset" --transport "$transport" $flags --repeats 4 \
    --json "$OUT/$name.json" 2>&1 | grep -v -i "warn" | tail -14
  echo "   ($(( $(date +%s) - start )) s)"
done
