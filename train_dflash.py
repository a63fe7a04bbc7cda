"""Train a DFlash drafter in one torchrun job: target ranks run the frozen target and stream hidden states to
drafter ranks, which train the drafter with DDP among themselves (or shard it with FSDP2: DRAFTER_SHARDING). No
external services. The algorithm:
docs/ALGORITHM.md; the route of a micro-batch and the role of each file: ARCHITECTURE.md.

    bash launch.sh                                                     # the usual way (tmux, log, allocator)
    torchrun --nproc-per-node 8 train_dflash.py --TARGET=/models/Qwen3-8B --DATA=/data/prepared --TARGET_RANKS=5
    python train_dflash.py --MAX_STEPS=20                              # one process: target and drafter in turn
    python train_dflash.py --help                                      # the constants below, grouped, with comments

Every constant below can be overridden as --NAME=VALUE (trainer/settings.py checks them). The final values are printed,
saved in OUT_DIR/run.json and in every checkpoint.
"""
import contextlib
import functools
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from data.loader import Data, Schedule, read_stats
from model import fp8
from model import drafters
from model.drafters import arch_of, unwrap
from model.drafter import Drafter, DrafterConfig
from model.objective import block_metrics, decay_weighted, micro_seed
from trainer import checkpoint as ckpt
from trainer import evaluate
from trainer import settings
from trainer.micro_batch import MicroBatchSums, autocast_for
from trainer.optim import lr_at, scale_clip_
from trainer.pipe import BusyClock, Prefetcher, TargetAhead
from trainer.phases import (Dist, build_drafter, choose_resume, drafter_config, load_data, load_target, resume,
                           run_device, run_target, schedule, start_feed, start_watchdog, startup_check)
from trainer.status import Metrics, Meter, log, log_peak_memory, log_plan, status_line
from trainer.watchdog import Watchdog, fail, failure_reason, finish, on_signals

_IMPORTED = set(globals())   # names above are not settings (CONFIG_KEYS below)
# Every setting is one constant below: its default, then its comment, written once: a number's allowed range first
# ([>= N] or [> N], then [< N] or [<= N] if bounded above), or a string's allowed values as a list (a | b (what b
# means) | c, then prose after a colon or a full stop), which trainer/settings.py reads and checks; then its meaning
# and units, continued on `#` lines below it. --help prints them, and docs/configuration.md's table is generated
# from them (python -m tools.config_page): a new setting is its constant, its comment and its test.

# --- what to train --------------------------------------------------------------------------------------------------
TARGET = ""                 # local HF folder of the frozen target; "" = SmolLM2-135M-Instruct (python -m tools.smollm2)
DATA = ""                   # prepared dataset folder (python -m data.prepare); "" = data/default/smollm2
OUT_DIR = "runs/dflash"     # checkpoints/, metrics.jsonl, run.json (launch.sh adds train.log)
INIT_FROM = ""              # exported drafter folder to start from (serving format, fp32 or bf16, e.g.
#                             runs/x/checkpoints/step_N/drafter); "" = random init. A fresh run: step 0, new optimizer,
#                             the LR schedule from its start. Its config.json is checked against this run's drafter
#                             before any model loads (each differing setting named with both values); a checkpoint to
#                             resume in OUT_DIR wins (the log says so)
NUM_DRAFT_LAYERS = 5        # [>= 1] L, drafter decoder layers
TARGET_LAYER_IDS = ""       # comma list of target layers to tap, e.g. "1,9,17,25,33"; "" = spread NUM_TAPS evenly
NUM_TAPS = 0                # [>= 0] K when TARGET_LAYER_IDS is "": 0 = NUM_DRAFT_LAYERS
BLOCK_SIZE = 16             # [>= 2] B, tokens per block: the anchor + B-1 drafted
MASK_TOKEN_ID = -1          # [>= -1] -1 = first unused id past the tokenizer (or an unused special token)
SLIDING_WINDOW_LAYERS = 0   # [>= 0] last S drafter layers use sliding-window attention (causal inside the block)
SLIDING_WINDOW = 0          # [>= 0] their window in tokens; 0 = the target's config value
DRAFTER_ARCH = "dflash"     # dflash | dflash2: DFlash plus block-local dynamic convolutions in every layer and a
                            # candidate selector that rescores each slot's unary top-K (model/dflash2.py). INIT_FROM a
                            # DFlash export starts a dflash2 run from its backbone (the new parameters at identity /
                            # zero init)
CONV_KERNEL_SIZE = 2        # [>= 1] dflash2: taps of each block-local convolution (<= BLOCK_SIZE)
CONV_GROUP_SIZE = 16        # [>= 1] dflash2: channels sharing one dynamic coefficient (must divide the target's hidden
                            # size)
SELECTOR_RANK = 256         # [>= 1] dflash2: rank of the selector's bilinear predecessor x hidden x candidate term (two
                            # [V, rank] codebooks)
SELECTOR_TOP_K = 16         # [>= 1] dflash2: unary candidates per slot the selector rescores (<= vocab size)
SELECTOR_ALPHA = 1.0        # [>= 0] dflash2: weight of the selector's K-way CE beside the block CE (speculators' 1.0);
                            # the status line adds sel_recall (gold in the top-K), sel_acc (teacher-forced pick) and
                            # sel_streak (the walk's own accepted length)

# --- objective ------------------------------------------------------------------------------------------------------
MAX_ANCHORS = 2048          # [>= 1] blocks per micro-batch (anchors sampled without replacement, fresh every step);
                            # 125 per 1K tokens at TOKEN_BUDGET 16384 (SpecForge's recipe: 167). SpecForge's
                            # num_anchors counts per sequence: MAX_ANCHORS = it x sequences per batch. Why this density:
                            # docs/configuration.md, anchor density
MIN_ANCHORS_PER_DOC = 1     # [>= 0] floor per sequence when MAX_ANCHORS binds, so short sequences are not starved
GAMMA = 7.0                 # [> 0] LOSS_WEIGHTING=exp: weight of slot k is exp(-(k-1)/GAMMA); 7 for B=16, 10 for B=32.
                            # Unused by the default dpace weighting (the log says so when GAMMA is set)
LOSS_WEIGHTING = "dpace"    # dpace (D-PACE, vLLM speculators' default: slot k weighs the sum over supervised j >= k of
                            # prod_{i<=j} ((1-a) q_i + a), q = the drafter's own detached probability of the label, so
                            # a slot counts as much as the acceptance riding on it) | exp (exp(-(k-1)/GAMMA), the
                            # paper's). dpace is the default for its tau at equal data and steps: BENCHMARKS.md,
                            # drafter quality
DPACE_ALPHA = 0.5           # [>= 0] [<= 1] D-PACE's confidence smoothing a: slot weights from (1-a)*q + a, q =
                            # p(label); 0 = the plain acceptance products, 1 = weights count the supervised slots
                            # from k on
NOISE = 0.0                 # [>= 0] uniform noise U(-NOISE, NOISE) on target hidden states before fc (0 = off)
CE_CHUNK = 4096             # [>= 0] rows of [rows, vocab] logits alive at once in the loss (0 = unchunked, tests only)

# --- data -----------------------------------------------------------------------------------------------------------
TOKEN_BUDGET = 16384        # [>= 2] tokens per micro-batch, padding included (target forward is [b, S] padded)
MAX_BATCH_SIZE = 64         # [>= 1] sequences per micro-batch
EPOCHS = 6                  # [>= 1] passes over the data (when MAX_STEPS is 0)
ALLOW_DATA_CHANGE = False   # resume even if the dataset changed (the LR schedule is re-planned over the new total)

# --- optimisation ---------------------------------------------------------------------------------------------------
GRAD_ACCUM = 1              # [>= 1] micro-batches per drafter rank per optimizer step
LR = 6e-4                   # [> 0] peak learning rate (AdamW, fp32 master weights)
WARMUP_RATIO = 0.04         # [>= 0] [< 1] fraction of the run spent in linear warmup, then cosine to 0
WEIGHT_DECAY = 0.0          # [>= 0] AdamW weight decay (0.0 - 0.01)
GRAD_CLIP = 1.0             # [> 0] max global grad norm
MAX_STEPS = 0               # [>= 0] optimizer steps of the run, repeating the data as needed (EPOCHS is then
                            # unused); 0 = EPOCHS over the data. The LR schedule spans the run

# --- topology and hardware --------------------------------------------------------------------------------------------
TARGET_RANKS = 1            # [>= 1] the first TARGET_RANKS ranks run the target, the rest train the drafter
TARGET_SHARDS = 1           # [>= 1] target ranks per replica: each holds 1/N of the target (FSDP2; docs/multi-gpu.md,
                            # targets larger than one GPU); TARGET_RANKS must be a multiple of it
DEVICE = "auto"             # auto | cuda | cpu
DTYPE = "auto"              # auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float32
ATTN = "auto"               # auto (flex on GPU, sdpa on CPU) | flex | sdpa
COMPILE_DRAFTER = "off"     # off | elementwise (fused RMSNorm + RoPE kernels) | layers (that + each layer one graph)
COMPILE_TARGET = False      # torch.compile each target decoder layer (compiled at its first forward, on the main
                            # thread; one process then runs its target forward there, a micro-batch ahead)
TARGET_FP8 = False          # the frozen target's decoder Linear layers up to the last tap in FP8 (torchao, per-row
                            # scales; embedding and lm_head stay bf16); SM89+ GPU only
DRAFTER_FP8 = False         # the drafter's layer Linear layers trained in FP8 (torchao float8 training in
                            # DRAFTER_FP8_RECIPE; fc and the lm_head + CE stay bf16); SM89+ GPU, meant with
                            # COMPILE_DRAFTER=layers and HEAD_FP8. Faster at Qwen3-8B shapes, slower at small hidden
                            # sizes; its speed and tau cost: BENCHMARKS.md, throughput at equal work, drafter quality
DRAFTER_FP8_RECIPE = "rowwise_with_gw_hp"   # rowwise_with_gw_hp (per-row scales, weight gradients in bf16) | rowwise
                            # (all three GEMMs FP8, per-row) | tensorwise (one scale per tensor, e5m2 gradients):
                            # torchao's float8 training recipes (model/fp8.py); the step time of each: BENCHMARKS.md,
                            # other figures
HEAD_FP8 = False            # the loss's two lm_head GEMMs (logits, input gradient) in FP8 through torch._scaled_mm,
                            # per-row scales, the frozen lm_head quantised once (model/fp8.py); SM89+ GPU; its speed
                            # and tau cost: BENCHMARKS.md, throughput at equal work, drafter quality
DRAFTER_SHARDING = "ddp"    # ddp (every drafter rank holds all weights, gradients and AdamW state) | fsdp (FSDP2 per
                            # drafter layer + root over the drafter ranks: 1/D of each per rank, bf16 compute on GPU,
                            # fp32 master shards, checkpoints sharded with torch.distributed.checkpoint; needs
                            # torchrun, not with DRAFTER_FP8; docs/multi-gpu.md, drafters larger than one GPU)
FLEX_OPTIONS = ""           # JSON kernel_options of the drafter's flex_attention, e.g. '{"USE_TMA": true}'; "" =
                            # torch's defaults (python -m bench.bench_dflash --mode flex times candidates)
OVERLAP_OPTIMIZER = True    # GPU: the AdamW update runs on a side stream one layer at a time while the next forward
                            # computes, each layer waiting only for its own update (trainer/optim.py); same results
                            # bitwise. False runs it after the backward
Q_PREFETCH = 4              # [>= 1] q_pre: padded batches a target rank prepares ahead
Q_HS = 8                    # [>= 1] q_hs: received micro-batches a drafter rank holds ahead of compute
SEND_DEPTH = 2              # [>= 1] feature tensors a target rank may have in flight

# --- checkpoints, logging, failure ------------------------------------------------------------------------------------
SAVE_EVERY = 500            # [>= 1] optimizer steps between checkpoints (also saved at the end and on SIGTERM/SIGINT)
KEEP_LAST = 3               # [>= 0] checkpoints kept
RESUME = "auto"             # auto (newest complete checkpoint in OUT_DIR, else start) | scratch | <checkpoint path>
SEED = 0                    # [>= 0] drafter init, anchor sampling and noise (per micro-batch, so resume is exact)
LOG_EVERY = 10              # [>= 1] optimizer steps between status lines
LOG_SECONDS = 60.0          # [> 0] ... or at most this many seconds (one drafter rank; several log by LOG_EVERY only)
HEARTBEAT_TIMEOUT = 30.0    # [> 0] s without a heartbeat before a rank is declared dead
STALL_TIMEOUT = 600.0       # [> 0] s without progress on any rank (after start-up) before the job is ended
EVAL_EVERY = 0              # [>= 0] run the tau evaluation on every N-th checkpoint (0 = off); on the master
                            # drafter rank
EVAL_PROMPTS = ""           # prompts JSONL for it ("" = data/default/eval_broad.jsonl, ten categories of traffic)
EVAL_LIMIT = 20             # [>= 1] prompts per evaluation, dealt over the categories (20 = 2 of each of the broad
                            # set's 10)
EVAL_MAX_NEW_TOKENS = 128   # [>= 1] tokens generated per prompt
EVAL_DTYPE = "float32"      # float32 | bfloat16: the target's dtype for it; float32 keeps the losslessness check exact
#                             (bf16 block vs one-token forwards round differently, which can flip near-tied greedy
#                             tokens)
TENSORBOARD = False         # also log to OUT_DIR/tb (tensorboard --logdir OUT_DIR/tb); the package is checked at
                            # start-up
WANDB_PROJECT = ""          # also log to this W&B project ("" = off); the run id is kept in OUT_DIR/wandb_run_id.txt,
                            # so a resume continues the same W&B run; the package is checked at start-up
DRY_RUN = False             # check the config and data, print the plan, exit before loading any model
DUMP_BATCHES = 0            # [>= 0] drafters save the first N received micro-batches to OUT_DIR/dump/ (debugging,
                            # tests)

CONFIG_KEYS = [k for k in list(globals()) if k.isupper() and not k.startswith("_") and k not in _IMPORTED]
REPO = Path(__file__).resolve().parent


# --- main: the job's phases -----------------------------------------------------------------------------------------

def main(argv):
    _, given = configure(argv)
    c = constants()   # frozen: every phase below reads the run's settings from it
    d = Dist(c)
    log(f"[rank {d.rank} {d.role}] {d}")
    out_dir = Path(c.OUT_DIR)
    ck_root = out_dir / "checkpoints"
    watchdog = start_watchdog(c, d)
    stop_flag = on_signals(f"[rank {d.rank} {d.role}]", watchdog, ck_root, log)
    try:
        # 1. settings that need the target's config and tokenizer, the data: all checked before any model loads
        c, dcfg, hf_cfg, eval_setup = drafter_config(c, d)
        init_notes = settings.check_init_from(c, dcfg) if c.INIT_FROM else []
        data = load_data(c, d, hf_cfg, watchdog)
        # 2. where to start, and the schedule from there
        resume_path = choose_resume(c, d, watchdog, out_dir, ck_root)
        fingerprint = ckpt.target_fingerprint(c.TARGET)
        rp = resume(c, d, watchdog, resume_path, data, dcfg, fingerprint)
        sched = schedule(c, d, data, rp)
        total_steps = rp.step + sched.steps
        if d.is_master:
            log_plan(d, c, given, data, sched, dcfg, rp.step, total_steps, resume_path, init_notes)
        if c.DRY_RUN:
            if d.is_master:
                log("DRY_RUN: config and data are fine; exiting before loading any model")
            finish(d, watchdog, code=0)
        if d.is_master:
            ckpt.write_run_info(out_dir, c.as_dict(), d.world, [d.n_targets, d.n_drafters], data, dcfg, fingerprint,
                                resume_path)
        # 3. a target rank's job: it ends there
        target = load_target(c, d, dcfg, watchdog) if d.is_target else None
        if d.is_target and not d.colocated:
            run_target(c, d, data, sched, target, watchdog)
        # 4. a drafter rank's (or the one process's) job: the drafter, its optimizer, the feed, then the loop
        drafter, model, opt, embed, head_w = build_drafter(c, d, dcfg, target, resume_path, watchdog)
        pre_stats = {}
        feed = start_feed(c, d, data, sched, target, dcfg, watchdog, pre_stats)
        train(Run(d=d, dcfg=dcfg, c=c, data=data, sched=sched, drafter=drafter,
                  model=model, opt=opt, embed=embed, head_w=head_w, feed=feed, pre_stats=pre_stats, watchdog=watchdog,
                  stop_flag=stop_flag, eval_setup=eval_setup, ck_root=ck_root, fingerprint=fingerprint, step=rp.step,
                  step0=rp.step, total_steps=total_steps))
        log_peak_memory(d)
        finish(d, watchdog, code=0)
    except SystemExit as e:
        if e.code not in (0, None) and watchdog:
            watchdog.fail(str(e.code).removeprefix("error: "))
        raise
    except Exception as e:  # noqa: BLE001 - every failure ends the whole job with a reason
        fail(watchdog, failure_reason(e, d.device, c), traceback.format_exc())


# --- the drafter loop, and the drafter step it runs -----------------------------------------------------------------

def train(run):
    """The drafter rank's loop: per optimizer step, its LR, GRAD_ACCUM micro-batches (each a drafter_step, below),
    the optimizer_step, then stop? log? save?, until the schedule ends or a signal asks to stop. run: a Run (the
    end of this file), what main's phases built."""
    c, d, B = run.c, run.d, run.dcfg.block_size
    if d.is_master:
        run.metrics = Metrics(Path(c.OUT_DIR), c)
        if run.watchdog:
            run.watchdog.on_abort.append(run.metrics.flush)
    autocast = autocast_for(d.device, d.dtype)
    params = list(run.drafter.parameters())
    step_w = torch.zeros(1, device=d.device, dtype=torch.float64)   # loss weight of this optimizer step
    clock = BusyClock(d.device)
    if run.watchdog:
        run.watchdog.collect.append(clock.poll)
    now = time.time()
    meter = Meter(MicroBatchSums.zeros(d.device), now, now, run.step, split_reported=d.colocated)
    if d.is_master:
        log(f"[rank {d.rank} {d.role}] waiting for the first micro-batch (target warm-up, queues filling) ...")
    first = True
    while run.step < run.total_steps:
        lr = lr_at(run.g_at(run.step), run.sched.planned_g, c.LR, c.WARMUP_RATIO)
        for group in run.opt.param_groups:
            group["lr"] = lr
        for m in range(c.GRAD_ACCUM):
            item = run.feed.get()
            if first:
                first = False
                first_micro_batch(run, meter)
            if run.watchdog:
                run.watchdog.state = f"training step {run.step + 1} micro-batch g={item.g}"
            t0 = clock.start()
            sums = drafter_step(run.model, run.embed, run.head_w, item, B, autocast, c,
                                sync=m == c.GRAD_ACCUM - 1 or d.n_drafters == 1)
            if m < c.GRAD_ACCUM - 1:
                clock.stop(t0, item.tokens)
            else:                                      # the step's last micro-batch: its busy time ends after the
                last_unit = (t0, item.tokens)          # optimizer, which is part of the drafter's per-step cost
            step_w += sums.objective_w
            meter.sums += torch.stack(sums)
            micro_batch_done(run, meter, item)
        optimizer_step(params, run.opt, step_w, c.GRAD_CLIP, d.n_drafters, d.drafters)
        clock.stop(*last_unit)
        run.step += 1
        stopping = stop_requested(run)
        now = time.time()
        log_now = run.step - meter.step_at_log >= c.LOG_EVERY or now - meter.t_log >= c.LOG_SECONDS or \
            run.step == run.total_steps or stopping
        if d.n_drafters > 1:   # every drafter must join the metric all-reduce: agree on when via the step count
            log_now = run.step % c.LOG_EVERY == 0 or run.step == run.total_steps or stopping
        if log_now:
            status_line(run, meter, params, lr, now)
        writes = d.is_master or c.DRAFTER_SHARDING == "fsdp"   # sharded: every drafter rank writes its shard
        if writes and (run.step % c.SAVE_EVERY == 0 or run.step == run.total_steps or stopping):
            t_pause = time.time()
            save_checkpoint(run)
            meter.t_log += time.time() - t_pause   # checkpoint and evaluation time is not training throughput
        if stopping:
            if d.is_master:
                log(f"stopped at step {run.step} on request; resume with RESUME=auto")
            break
    run.opt.wait_all()
    if d.is_master:
        if run.step >= run.total_steps:
            log(f"done: {run.step} steps; final drafter in {ckpt.step_dir(run.ck_root, run.step) / 'drafter'}")
        run.metrics.flush()


def drafter_step(model, embed, head_w, item, block_size, autocast, c, sync=True, probe=None,
                 saved_hooks=None) -> MicroBatchSums:
    """One micro-batch's forward, loss and backward: the gradients accumulate sum(w * CE) until optimizer_step.
    The loss is the drafter family's (model/drafters.py: DFlash's is model/objective.py's weighted CE over the blocks).
    c: the run's settings (NOISE, SEED; the loss reads LOSS_WEIGHTING, DPACE_ALPHA, CE_CHUNK and its arch's own,
    Arch.loss_settings); the sums are MicroBatchSums, the arch's metrics in its slots. sync=False: a DDP
    model skips its gradient all-reduce (not the step's last micro-batch). probe(phase) and saved_hooks: the bench's
    instruments (bench/bench_dflash.py times this same function)."""
    probe = probe or (lambda phase: None)
    feats = item.features                                                                    # [T, K*H]
    if c.NOISE:
        gen = torch.Generator(device=feats.device).manual_seed(micro_seed(c.SEED, item.g))
        feats = feats + (torch.rand(feats.shape, generator=gen, device=feats.device, dtype=torch.float32)
                         * 2 - 1).mul_(c.NOISE).to(feats.dtype)
    no_sync = model.no_sync() if (not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):   # FSDP2: reduce-scatter only after the step's last micro-batch
        model.set_requires_gradient_sync(sync)
    with no_sync, autocast:
        with saved_hooks or contextlib.nullcontext():
            hidden = model(feats, item.ctx_pos, embed(item.block_ids), item.block_pos, item.attn)   # [N*B, H]
            probe("forward")
            arch = arch_of(model)
            parts, extra = arch.loss(unwrap(model), hidden, head_w, item, c)
            probe("CE")
        parts.loss_sum.backward()
    probe("backward")
    bm = block_metrics(parts.correct.view(-1, block_size), item.weights.view(-1, block_size))
    loss, loss_w = decay_weighted(parts, item, c.LOSS_WEIGHTING)
    return MicroBatchSums.of(loss=loss, loss_w=loss_w, acc_num=bm["acc_num"], acc_den=bm["acc_den"],
                             streak_num=bm["streak_num"], streak_den=bm["streak_den"],
                             objective=parts.loss_sum.detach(), objective_w=parts.weight_sum,
                             arch=[extra[k] for k in arch.metrics])


def optimizer_step(params, opt, step_w, grad_clip, n_drafters=1, group=None):
    """The update after a step's micro-batches. Global normalisation: the gradients hold sum(w * CE) (averaged over
    the n_drafters ranks of `group` by DDP's all-reduce, or FSDP2's reduce-scatter, which averages the same way),
    step_w [1] this rank's sum of w: divide by the global one."""
    if n_drafters > 1:
        dist.all_reduce(step_w, group=group)
    scale_clip_(params, (n_drafters / step_w.clamp(min=1e-12)).float(), grad_clip, opt)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_w.zero_()


# --- the loop's bookkeeping: start-up, a micro-batch done, a stop request, checkpoints, evaluation ------------------

def first_micro_batch(run, meter):
    """Start-up is over: stall detection on, the clocks restart (start-up is not throughput)."""
    d = run.d
    if run.watchdog:
        run.watchdog.steady = True
    if d.is_master:
        log(f"[rank {d.rank} {d.role}] first micro-batch after {time.time() - meter.t_start:.1f}s; training")
    meter.t_start = meter.t_log = time.time()
    if d.is_master and run.watchdog:
        meter.tgt_n_prev = sum((s or {}).get("n", 0) for s in run.watchdog.peer_states(range(d.n_targets)).values())


def micro_batch_done(run, meter, item):
    c = run.c
    if c.DUMP_BATCHES and item.g < c.DUMP_BATCHES:   # exactly what arrived, for checking the transport
        dump = Path(c.OUT_DIR) / "dump"
        dump.mkdir(parents=True, exist_ok=True)
        torch.save({"g": item.g, "rank": run.d.rank, "features": item.features.cpu(), "lengths": item.lengths,
                    "input_ids": item.input_ids}, dump / f"g{item.g:06d}.pt")
    meter.tokens += item.tokens
    meter.run_tokens += item.tokens
    meter.micro_batches += 1
    if run.watchdog:
        run.watchdog.progress()
        run.watchdog.stats.update(q=run.feed.q.qsize(), n=run.watchdog.stats.get("n", 0) + 1,
                                  tok=run.watchdog.stats.get("tok", 0) + item.tokens)


def stop_requested(run) -> bool:
    """A signal on any rank -> every drafter stops after the same step, agreed through the store (the master
    publishes it, and the micro-batch the target ranks stop before). -> whether this step is the last."""
    d = run.d
    if d.store:
        if run.stop_flag.is_set() and not d.store.check(["stop_request"]):
            d.store.set("stop_request", str(d.rank))
        if d.is_master and run.stop_at is None and d.store.check(["stop_request"]):
            run.stop_at = run.step + 1
            d.store.set("stop_at", str(run.stop_at))
            d.store.set("stop_g", str(run.g_at(run.stop_at)))
        if run.stop_at is None and d.store.check(["stop_at"]):
            run.stop_at = int(d.store.get("stop_at"))
    elif run.stop_flag.is_set() and run.stop_at is None:
        run.stop_at = run.step
    return run.stop_at is not None and run.step >= run.stop_at


def save_checkpoint(run):
    """The master's checkpoint after run.step (trainer/checkpoint.py's schema); every EVAL_EVERY-th one is evaluated
    just before it is written, so its export's model card carries that tau. DRAFTER_SHARDING=fsdp: every drafter
    rank calls it, writes its shard into the master's folder (checkpoint.save_shards) and takes part in gathering the
    whole drafter for the serving export."""
    c, d = run.c, run.d
    if run.watchdog:
        run.watchdog.state = f"saving checkpoint step {run.step}"
    run.opt.wait_all()   # the overlapped optimizer's last update has run (parameters and its state)
    sharded = c.DRAFTER_SHARDING == "fsdp"
    full = ckpt.full_state(run.drafter, keep=d.is_master) if sharded else None   # fp32, on the master's CPU
    shards = functools.partial(ckpt.save_shards, model=run.drafter, opt=run.opt, group=d.drafters) \
        if sharded else None
    if not d.is_master:
        shards(ckpt.tmp_dir(run.ck_root, run.step))
        return
    g = run.g_at(run.step)
    # every EVAL_EVERY-th checkpoint is evaluated before it is written, so its export's model card carries its tau
    whole = (lambda: ckpt.whole_drafter(run.dcfg, full, d.device, drafters.ARCHS[c.DRAFTER_ARCH].drafter)) if sharded \
        else (lambda: run.drafter)
    ev = evaluate_checkpoint(run, whole()) \
        if c.EVAL_EVERY and (run.saves + 1) % c.EVAL_EVERY == 0 else None
    # the card's data hash is stats.json's, which a user can compare (Data.content_hash is the loader's own)
    card = dict(target=c.TARGET, target_fingerprint=run.fingerprint, step=run.step, evaluation=ev,
                data={"rows": run.data.num_rows, "content_hash": read_stats(c.DATA).get("content_hash")})
    state = ckpt.train_state(run.drafter, run.opt, run.step, g, sharded=sharded)
    meta = ckpt.train_meta(run.step, g, run.sched.planned_g, [d.n_targets, d.n_drafters], c.as_dict(), run.data,
                           run.dcfg, run.fingerprint)
    t = time.time()
    try:
        export = lambda p: drafters.export(run.drafter, p, state=full, **card)   # noqa: E731
        path = ckpt.save(run.ck_root, run.step, state, meta, export, c.KEEP_LAST, write_shards=shards)
    except ckpt.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    log(f"saved {path} ({time.time() - t:.1f}s)")
    run.saves += 1


def evaluate_checkpoint(run, drafter):
    """tau of the current drafter (run.drafter, or its whole copy when sharded) on EVAL_PROMPTS, on this rank; peers
    wait at the next collective, targets keep filling the queues. The watchdog knows (its stall check pauses), and
    the HF target it loads in EVAL_DTYPE is freed afterwards (trainer/planner.py counts it in the drafter's peak)."""
    c, d, setup = run.c, run.d, run.eval_setup
    run.opt.wait_all()
    t = time.time()
    with run.watchdog.pause(f"evaluating tau at step {run.step}") if run.watchdog else contextlib.nullcontext():
        target_model = AutoModelForCausalLM.from_pretrained(c.TARGET, dtype=getattr(torch, c.EVAL_DTYPE),
                                                            attn_implementation="sdpa",
                                                            local_files_only=True).to(d.device).eval()
        drafter.eval()
        with torch.no_grad():
            res = evaluate.evaluate(target_model, setup["tok"], drafter, setup["prompts"],
                                    max_new_tokens=c.EVAL_MAX_NEW_TOKENS, device=d.device, on_too_long="skip",
                                    reference=run.eval_reference, enable_thinking=setup["enable_thinking"], log=None)
        del target_model
        if d.device.type == "cuda":
            torch.cuda.empty_cache()   # give the evaluation's memory back to training
    drafter.train()
    run.last_eval.update(tau=res["tau"], lossless=res["lossless"])
    run.metrics.write({"time": time.time(), "step": run.step, "tau": res["tau"], "lossless": res["lossless"],
                       "tau_by_category": res.get("tau_by_category"), "tf_streak": res.get("tf_streak"),
                       "tau_categories": res["tau_categories"], "tau_macro": res["tau_macro"],
                       "tau_macro_se": res["tau_macro_se"], "eval_s": time.time() - t})
    # tf_streak: the training streak measured on these prompts' greedy outputs. tau ~ 1 + tf_streak when serving
    # matches training; tf_streak far below the status line's streak = the drafter does not generalise to them
    tf = res.get("tf_streak")
    macro = "-" if res["tau_macro"] is None else f"{res['tau_macro']:.2f}"
    log(f"eval step {run.step}: tau={res['tau']:.2f} macro_tau={macro} ({len(res['tau_categories'])} categories) "
        f"lossless={'yes' if res['lossless'] else 'no'} "
        f"prompts={len(setup['prompts'])} held-out streak={'-' if tf is None else f'{tf:.2f}'} "
        f"({time.time() - t:.0f}s)")
    return dict(res, prompts_file=setup["path"].name)


@dataclass
class Run:
    """What the drafter loop reads and updates, built by main's phases."""
    d: Dist
    dcfg: DrafterConfig
    c: settings.Settings           # the run's settings (MASK_TOKEN_ID, TARGET_LAYER_IDS filled in), snapshotted
                                   # into every checkpoint
    data: Data
    sched: Schedule
    drafter: Drafter               # fp32 master weights
    model: torch.nn.Module         # the drafter (FSDP2-sharded with DRAFTER_SHARDING=fsdp), or its DDP wrapper
    opt: torch.optim.Optimizer
    embed: torch.nn.Embedding      # the target's, frozen
    head_w: torch.Tensor | fp8.HeadFP8   # [V, H] the target's lm_head, frozen (HEAD_FP8: with its FP8 copies)
    feed: Prefetcher | TargetAhead
    pre_stats: dict                # the one process's q_pre depth (produce writes it)
    watchdog: Watchdog | None
    stop_flag: threading.Event     # set by a signal
    eval_setup: dict | None
    ck_root: Path
    fingerprint: dict              # the target's, in every checkpoint: a resume checks its target against it
    step: int                      # optimizer steps done
    step0: int                     # ... when this run started
    total_steps: int
    metrics: Metrics | None = None
    saves: int = 0                 # checkpoints this run wrote (EVAL_EVERY counts them)
    eval_reference: dict = field(default_factory=dict)   # greedy decodes: they depend on the target and prompts only
    last_eval: dict = field(default_factory=dict)
    stop_at: int | None = None     # the step after which every drafter stops (a signal)

    def g_at(self, step):  # first micro-batch of optimizer step `step` (counted from the run's start step)
        return self.sched.g_at(step - self.step0)


# --- the constants as the run's settings ----------------------------------------------------------------------------

def constants() -> settings.Settings:
    """The constants above as they are now (after main's overrides), frozen: what the library reads as c.NAME."""
    return settings.Settings(**{k: globals()[k] for k in CONFIG_KEYS})


def defaults(**overrides) -> settings.Settings:
    """The constants above with `overrides` (names of constants), frozen: a bench's or a test's settings."""
    return constants().replace(**overrides)


def configure(argv) -> tuple[dict, set[str]]:
    """--NAME=VALUE overrides and the embedded defaults applied to the constants above (main, and launch.sh's check
    before it starts a job). -> (the run's settings, the names given on the command line)."""
    config, given = settings.parse_overrides(argv, {k: globals()[k] for k in CONFIG_KEYS}, Path(__file__))
    settings.resolve_paths(config)
    globals().update(config)   # the constants above now hold the run's values
    return config, given


def check_config(world: int) -> None:
    """The job's whole start-up check on the constants as they are now (roles.startup_check: the settings, CUDA for
    DEVICE=cuda, FP8 on the device, the trackers' packages): launch.sh's check before it starts a job."""
    c = constants()
    startup_check(c, world, run_device(c))


if __name__ == "__main__":
    main(sys.argv[1:])
