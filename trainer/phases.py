"""main's phases of train_dflash.py, named in the order main calls them: who this process is (`Dist`) and its watchdog
(`start_watchdog`), the settings that need the target's config and tokenizer (`drafter_config`, with the in-training
evaluation's prompts, `eval_inputs`), the data and the memory plan (`load_data`), where to start (`choose_resume`,
`resume`) and the schedule from there (`schedule`), a target rank's job
(`load_target`, `run_target`), and a drafter rank's set-up (`build_drafter` with `shard_drafter` and
`restore_drafter`, `start_feed`). Each takes the run's settings `c` (trainer.settings.Settings, read as c.NAME) and
this process's `Dist`; none reads train_dflash's globals. The file opens with helpers of theirs (`eval_inputs`,
`run_device`, `startup_check`), then holds the phases in that order."""
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoTokenizer

from data.loader import Data, DataError, Schedule, read_stats, tokenizer_mismatches
from data.prompts import load_prompts, prompt_messages, refused_by_template, spread, template_refusal_message
from model import fp8
from model.attention import set_flex_kernel_options, warmup_flex_attention
from model import drafters
from model.drafter import DrafterConfig, compile_drafter
from model.drafters import ARCHS
from model.target import Target, load_frozen_io
from trainer import checkpoint as ckpt
from trainer import planner
from trainer import settings
from trainer.micro_batch import make_prepare, mask_lengths
from trainer.optim import make_optimizer
from trainer.pipe import BusyClock, Prefetcher, Replica, Sender, StopPoint, TargetAhead, produce, receive
from trainer.status import Phase, check_trackers, log, log_peak_memory
from trainer.watchdog import Watchdog, fail, wait_done


def eval_inputs(c, tok, stats: dict) -> dict:
    """EVAL_EVERY's prompts (EVAL_LIMIT of them dealt over the categories: load_prompts), checked at
    start-up (a bad row used to end the job at its first evaluation), and the dataset's thinking mode
    (data.prepare's stats.json), so the drafter is measured on prompts rendered as it was trained. tok: TARGET's
    tokenizer or None. -> {prompts, enable_thinking, path, tok}."""
    path = Path(c.EVAL_PROMPTS or settings.DEFAULT_EVAL_PROMPTS)
    thinking = stats.get("thinking")
    try:
        prompts = load_prompts(path)
        for row in prompts:
            if "input_ids" not in row:
                prompt_messages(row)
                if tok is None:
                    raise ValueError(f"prompt {row['id']!r} is text, and TARGET={c.TARGET} has no tokenizer to encode "
                                     f"it: give its rows as input_ids")
        # prompts TARGET's template will not render (a template without a system role, and the broad set's system
        # category) are left out, said once: the evaluation follows the run's progress on what the target can take
        if tok is not None and (refused := refused_by_template(tok, prompts, {"on": True, "off": False}
                                                                              .get(thinking))):
            print(f"note: EVAL_PROMPTS: {template_refusal_message(refused, prompts)}; the in-training "
                  f"evaluation leaves them out", flush=True)
            left_out = {r["id"] for r, _ in refused}
            prompts = [r for r in prompts if r["id"] not in left_out]
        prompts = spread(prompts, c.EVAL_LIMIT) if c.EVAL_LIMIT else prompts
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        sys.exit(f"error: EVAL_PROMPTS={path}: {type(e).__name__ + ': ' if not isinstance(e, ValueError) else ''}{e}")
    if not prompts:
        sys.exit(f"error: EVAL_PROMPTS={path} holds no prompts the target can take (a JSONL of prompts, see "
                 f"eval_dflash.py)")
    return {"prompts": prompts, "path": path, "enable_thinking": {"on": True, "off": False}.get(thinking), "tok": tok}


# --- who this process is -------------------------------------------------------------------------------------------

def run_device(c, local_rank: int = 0) -> torch.device:
    """The device of the rank with this local rank: DEVICE, where auto is CUDA when torch sees a GPU."""
    use_cuda = c.DEVICE == "cuda" or (c.DEVICE == "auto" and torch.cuda.is_available())
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")


def startup_check(c, world: int, device: torch.device) -> None:
    """The whole start-up check, before any model loads (every rank in Dist; launch.sh through train_dflash's
    check_config): settings.check_config, then what needs this machine: CUDA for DEVICE=cuda, FP8 on the run's
    device and the trackers' optional packages."""
    settings.check_config(c, world)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: DEVICE=cuda but torch sees no CUDA device (a CPU build of torch, or no GPU visible): set "
                 "--DEVICE=auto or --DEVICE=cpu")
    errs = [e for name in ("TARGET_FP8", "DRAFTER_FP8", "HEAD_FP8") if getattr(c, name) and
            (e := fp8.check(name, device))] + check_trackers(c.TENSORBOARD, c.WANDB_PROJECT)
    if errs:
        sys.exit("error: " + "; ".join(errs))


class Dist:
    """Who this process is. One process (no torchrun) = target and drafter in turn, no transport."""

    def __init__(self, c):
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = run_device(c, self.local_rank)
        startup_check(c, self.world, self.device)   # every rank checks: the whole job stops before any model loads
        self.colocated = self.world == 1
        self.n_targets = 1 if self.colocated else c.TARGET_RANKS
        self.n_drafters = 1 if self.colocated else self.world - c.TARGET_RANKS
        self.is_target = self.colocated or self.rank < c.TARGET_RANKS
        self.is_drafter = self.colocated or self.rank >= c.TARGET_RANKS
        self.is_master = self.colocated or self.rank == c.TARGET_RANKS          # first drafter: logs and saves
        self.drafter_index = 0 if self.colocated else self.rank - c.TARGET_RANKS
        # target replicas: ranks [i*N, (i+1)*N) share one sharded target (TARGET_SHARDS = N)
        self.shards = 1 if self.colocated else c.TARGET_SHARDS
        self.n_replicas = self.n_targets // self.shards
        first = self.rank // self.shards * self.shards
        self.replica_ranks = range(first, first + self.shards) if self.is_target else range(0)
        self.roles = ["target" if r < self.n_targets else "drafter" for r in range(self.world)]
        self.role = "target+drafter" if self.colocated else self.roles[self.rank]
        use_cuda = self.device.type == "cuda"
        if use_cuda:
            torch.cuda.set_device(self.local_rank)
        else:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))   # ranks share the CPU
        self.dtype = {"auto": torch.bfloat16 if use_cuda else torch.float32, "bfloat16": torch.bfloat16,
                      "float32": torch.float32}[c.DTYPE]
        self.flex = c.ATTN == "flex" or (c.ATTN == "auto" and use_cuda)
        self.ctrl = self.data = self.drafters = self.store = None
        self.shard_group = self.shard_ctrl = None   # a sharded target's replica: FSDP's group, pipe.Replica's (gloo)
        if not self.colocated:
            backend = "nccl" if use_cuda else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=max(1800.0, c.STALL_TIMEOUT)),
                                    device_id=self.device if use_cuda else None)
            assert dist.get_world_size() == self.world
            self.data = dist.group.WORLD                                        # features: NCCL on GPU
            self.ctrl = dist.new_group(backend="gloo")                          # headers and token ids: CPU
            self.drafters = dist.new_group(list(range(self.n_targets, self.world)))  # DDP among drafters only
            for i in range(self.n_replicas if self.shards > 1 else 0):          # every rank makes every group
                ranks = list(range(i * self.shards, (i + 1) * self.shards))
                group, ctrl = dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
                if self.rank in ranks:
                    self.shard_group, self.shard_ctrl = group, ctrl
            self.store = dist.distributed_c10d._get_default_store()

    def __str__(self):
        shard = f", target replica {self.rank // self.shards} shard {self.rank % self.shards + 1}/{self.shards}" \
            if self.shards > 1 and self.is_target else ""
        return (f"rank {self.rank}/{self.world} {self.role} on {self.device} ({self.dtype}, "
                f"attention={'flex' if self.flex else 'sdpa'}) pid {os.getpid()}{shard}")


def start_watchdog(c, d) -> Watchdog | None:
    """This rank's watchdog (heartbeats, the stall check, a named exit for the whole job), started; None in one
    process (nothing to watch but itself)."""
    if d.colocated:
        return None
    watchdog = Watchdog(d.store, d.rank, d.world, d.roles, c.HEARTBEAT_TIMEOUT, c.STALL_TIMEOUT, log=log,
                        is_master=d.is_master)
    watchdog.start()
    return watchdog


# --- before any model loads: settings from the target's config, the data, where to start ------------------------

def drafter_config(c, d):
    """What needs the target's config and tokenizer (no weights yet): the data's tokenizer check, the evaluation's
    prompts, the MASK id, the DrafterConfig. -> (the settings with MASK_TOKEN_ID and TARGET_LAYER_IDS filled in,
    dcfg, hf_cfg, eval_setup or None)."""
    hf_cfg = AutoConfig.from_pretrained(c.TARGET, local_files_only=True).get_text_config()
    try:
        tok = AutoTokenizer.from_pretrained(c.TARGET, local_files_only=True)
    except (OSError, ValueError):
        tok = None
    try:
        stats = read_stats(c.DATA)
    except DataError as e:
        sys.exit(f"error: {e}")
    if tok is not None and stats:
        errs = tokenizer_mismatches(stats, tok, c.DATA, c.TARGET)
        if errs:
            sys.exit("error: DATA does not match TARGET:\n  - " + "\n  - ".join(errs))
    elif d.is_master and stats.get("tokenizer_hash"):
        log(f"NOTE: TARGET={c.TARGET} has no tokenizer: DATA's tokenizer ({stats.get('tokenizer')}) is not checked")
    eval_setup = eval_inputs(c, tok, stats) if c.EVAL_EVERY else None
    if eval_setup and d.is_master:
        log(f"eval: every {c.EVAL_EVERY} checkpoint(s), {len(eval_setup['prompts'])} prompts of {eval_setup['path']}, "
            f"thinking={stats.get('thinking') or 'the template default'} (as DATA was prepared)")
    mask_id = settings.choose_mask_token_id(c, tok, hf_cfg.vocab_size)
    layer_ids = [int(x) for x in c.TARGET_LAYER_IDS.split(",")] if c.TARGET_LAYER_IDS else None
    try:
        dcfg = DrafterConfig.from_target(hf_cfg, c.NUM_DRAFT_LAYERS, c.BLOCK_SIZE, mask_id, target_layer_ids=layer_ids,
                                         num_taps=c.NUM_TAPS or None, sliding_window_layers=c.SLIDING_WINDOW_LAYERS,
                                         sliding_window=c.SLIDING_WINDOW or None)
        dcfg = drafters.make_config(c.DRAFTER_ARCH, dcfg, c)   # with the arch's knobs (Arch.knobs) from c
    except AssertionError as e:
        sys.exit(f"error: drafter config: {e}")
    c = c.replace(MASK_TOKEN_ID=mask_id, TARGET_LAYER_IDS=",".join(map(str, dcfg.target_layer_ids)))
    return c, dcfg, hf_cfg, eval_setup


def load_data(c, d, hf_cfg, watchdog):
    """The dataset and its batch plan; on a GPU also the memory plan per role, refusing what cannot fit."""
    with Phase(d, "load data", watchdog):
        try:
            data = Data(c.DATA, hf_cfg.vocab_size, c.TOKEN_BUDGET, c.MAX_BATCH_SIZE, seed=c.SEED)
        except DataError as e:
            sys.exit(f"error: {e}")
    if d.device.type == "cuda":
        gpu_mem = torch.cuda.get_device_properties(d.device).total_memory
        mplan = planner.estimate(c, hf_cfg, d.world, gpu_mem, max_len=int(max(data.plan.lengths)))
        if d.is_master:
            log(planner.format_plan(mplan))
        d.mem_estimate = mplan["roles"][d.role]["total"]                  # read back by log_peak_memory
        errs = planner.check_fits(mplan, gpu_mem)
        if errs:
            sys.exit("error: the config does not fit this GPU (trainer/planner.py):\n  - " + "\n  - ".join(errs))
    return data


def choose_resume(c, d, watchdog, out_dir, ck_root):
    """The checkpoint to resume (or None): chosen by the master, which also takes OUT_DIR's lock, and shared with
    every rank through the store."""
    if d.is_master and not c.DRY_RUN:   # one job per OUT_DIR, from here to the process's exit
        try:
            ckpt.lock_out_dir(out_dir, log=log)
        except ckpt.CheckpointError as e:
            fail(watchdog, str(e))
    if not d.is_master:
        return (d.store.get("resume_path").decode() or None) if d.store else None
    resume_path = None
    existing = ckpt.list_checkpoints(ck_root)
    if c.RESUME == "scratch" and existing:
        fail(watchdog, f"RESUME=scratch but {ck_root} already holds checkpoints ({existing[-1].name}); nothing was "
                       f"overwritten. Use RESUME=auto to continue, or another OUT_DIR")
    elif c.RESUME == "auto":
        resume_path = ckpt.latest_complete(ck_root, log=log)
        if existing and resume_path is None:
            log(f"WARNING: no complete checkpoint among {len(existing)} in {ck_root}: starting from scratch")
    elif c.RESUME != "scratch":
        try:
            ckpt.verify(c.RESUME)
        except ckpt.CheckpointError as e:
            fail(watchdog, f"RESUME={c.RESUME}: {e}")
        resume_path = Path(c.RESUME)
    if d.store:
        d.store.set("resume_path", str(resume_path or ""))
    return resume_path


def resume(c, d, watchdog, resume_path, data, dcfg, fingerprint) -> ckpt.ResumePoint:
    """Where this run starts: the checkpoint's point (checkpoint.resume_point), after refusing a checkpoint trained
    for another drafter shape or target."""
    meta = ckpt.read_meta(resume_path) if resume_path else None
    if meta:
        errs = ckpt.resume_mismatches(meta, dcfg, fingerprint)
        was = meta["config"].get("DRAFTER_ARCH", "dflash")   # checkpoints before the archs were all DFlash
        if was != c.DRAFTER_ARCH:
            arch = ARCHS[c.DRAFTER_ARCH]
            hint = f" (to turn a {ARCHS[was].title} drafter into a {arch.title} one, pass its export as INIT_FROM in " \
                   f"a new OUT_DIR)" if arch.warm_from == was else ""
            errs.insert(0, f"DRAFTER_ARCH: the checkpoint trained a {was} drafter, this run {c.DRAFTER_ARCH}{hint}")
        if errs:
            fail(watchdog, f"cannot resume {resume_path}: this run differs in what the checkpoint was trained for:\n"
                           f"  - " + "\n  - ".join(errs) + "\nResume with the checkpoint's settings and TARGET, or "
                           f"start over in another OUT_DIR")
        if d.is_master and not meta.get("target"):
            log(f"WARNING: {resume_path} records no target fingerprint (written by an older version): the TARGET "
                f"is not checked against it")
        elif d.is_master and meta["target"]["path"] != fingerprint["path"]:
            log(f"NOTE: TARGET moved since the checkpoint ({meta['target']['path']} -> {fingerprint['path']}); "
                f"same config and weights")
    rp = ckpt.resume_point(meta, data, c)
    if d.is_master:
        for note in rp.notes:
            log(note)
    if rp.error:
        fail(watchdog, f"cannot resume {resume_path}: {rp.error}")
    if meta and d.is_master:
        for note in ckpt.environment_notes(meta, [d.n_targets, d.n_drafters], rp.start_g):
            log(note)
    return rp


def schedule(c, d, data, rp: ckpt.ResumePoint) -> Schedule:
    """The micro-batches each drafter rank trains on from the resume point: EPOCHS over the data or MAX_STEPS."""
    try:
        return Schedule(data.plan.num_batches, d.n_targets, d.n_drafters, c.GRAD_ACCUM, c.EPOCHS, c.MAX_STEPS,
                        rp.start_g, rp.planned_g)
    except DataError as e:
        sys.exit(f"error: {e}")


# --- a target rank ---------------------------------------------------------------------------------------------------

def load_target(c, d, dcfg, watchdog):
    """The frozen target of a target rank (or the one process): FP8 and compiled as configured."""
    sharded = f" (1/{d.shards} of layers 0..{max(dcfg.target_layer_ids)} per rank, FSDP2)" if d.shards > 1 else ""
    with Phase(d, f"load target {c.TARGET}{sharded}", watchdog):
        target = Target(c.TARGET, d.device, d.dtype, dcfg.target_layer_ids, shard_group=d.shard_group)
    if target.sharded:
        params = list(target.decoder.parameters())
        held, whole = sum(p.to_local().numel() for p in params), sum(p.numel() for p in params)
        log(f"[rank {d.rank} {d.role}] holds {held:,} of the {whole:,} target parameters it runs "
            f"({held / whole:.1%}; replica {d.rank // d.shards} = ranks {d.replica_ranks[0]}..{d.replica_ranks[-1]})")
    if c.TARGET_FP8:   # before compiling: the compiled layers then fuse the activations' FP8 casts
        log(f"[rank {d.rank} {d.role}] TARGET_FP8: {fp8.quantize_target(target)} Linear layers of target "
            f"layers 0..{max(dcfg.target_layer_ids)} in FP8 (per-row scales)")
    if c.COMPILE_TARGET:
        target.compile_layers()   # compiled at its first forward, on the main thread (the one process's too)
    return target


def run_target(c, d, data, sched, target, watchdog):
    """A target rank's whole job: its micro-batches through the target and out to their drafters; never returns."""
    sender = Sender(d.ctrl, d.data, c.SEND_DEPTH, watchdog)
    sender.start()
    clock = BusyClock(d.device)
    watchdog.collect.append(clock.poll)
    watchdog.steady = True
    watchdog.state = "producing"
    n0 = 0
    replica = Replica(d.shard_ctrl, [sched.target_gs(r) for r in d.replica_ranks], d.rank % d.shards) \
        if d.shards > 1 else None
    for p in produce(data, sched.target_gs(d.rank), target, d.device, c.Q_PREFETCH, StopPoint(d.store, sched.total_g),
                     watchdog, clock, replica=replica):
        sender.put(d.n_targets + sched.consumer(p.g), p)
        watchdog.progress()
        n0 += 1
        watchdog.stats.update(n=n0, tok=sender.tokens, q=watchdog.stats.get("q", 0))
    watchdog.state = "all micro-batches produced; waiting for the drafters to finish"
    log_peak_memory(d)
    wait_done(d, watchdog)


# --- a drafter rank (or the one process) ------------------------------------------------------------------------

def build_drafter(c, d, dcfg, target, resume_path, watchdog):
    """fp32 master weights (from the checkpoint, INIT_FROM or SEED), the frozen embedding / lm_head, the optimizer;
    compiled, and wrapped in DDP or sharded with FSDP2 (DRAFTER_SHARDING) as configured.
    -> (drafter, model, opt, embed, head_w)."""
    sharded = c.DRAFTER_SHARDING == "fsdp"
    with Phase(d, "build drafter", watchdog):
        torch.manual_seed(c.SEED)
        drafter = ARCHS[c.DRAFTER_ARCH].drafter(dcfg).to(d.device)   # fp32 master weights
        if c.DRAFTER_FP8:   # the same parameters in other modules: before the optimizer and the compile
            n = fp8.convert_drafter(drafter, recipe=c.DRAFTER_FP8_RECIPE)
            log(f"[rank {d.rank} {d.role}] DRAFTER_FP8: {n} Linear layers train in FP8 ({c.DRAFTER_FP8_RECIPE}); fc "
                f"and the lm_head stay bf16" + ("" if c.COMPILE_DRAFTER == "layers" else
                                                "; meant with COMPILE_DRAFTER=layers, which fuses its casts"))
        # not sharded: frozen, outside the optimizer, so sharding would save only their bf16 copy, for an all-gather
        # of [V, H] every micro-batch
        embed, head_w, _ = load_frozen_io(c.TARGET, d.device, d.dtype) if target is None else \
            (target.embed_tokens, target.lm_head_weight, None)
        if c.HEAD_FP8:   # quantised once; the bf16 weight stays inside it for the rest
            head_w = fp8.HeadFP8(head_w)
            log(f"[rank {d.rank} {d.role}] HEAD_FP8: the loss's lm_head GEMMs in FP8 ([{head_w.weight.shape[0]}, "
                f"{head_w.weight.shape[1]}] quantised per row and per column, "
                f"{2 * head_w.weight.numel() / 2 ** 30:.2f} GiB)")
        if c.INIT_FROM and not resume_path:
            dtype = settings.load_init_from(c.INIT_FROM, drafter)
            if d.is_master:
                log(f"INIT_FROM: drafter weights from {c.INIT_FROM} ({dtype} export, into float32 master weights); "
                    f"a fresh run: step 0, new optimizer, the LR schedule from its start")
        if c.COMPILE_DRAFTER != "off":
            compile_drafter(drafter, c.COMPILE_DRAFTER)   # compiled by the first step, on this (the main) thread
        if sharded:                                     # replaces the parameters: before the optimizer is made
            shard_drafter(d, drafter)
        # the overlapped step would race FSDP2's all-gather of the root's parameters (fc, norms), which runs before
        # the forward's first params_ready wait; sharded, the step is 1/D of the work anyway
        opt = make_optimizer(drafter, c.LR, c.WEIGHT_DECAY, overlap=c.OVERLAP_OPTIMIZER and not sharded)
        if sharded and c.OVERLAP_OPTIMIZER and d.is_master and d.device.type == "cuda":
            log("NOTE: DRAFTER_SHARDING=fsdp: the optimizer step runs in line (OVERLAP_OPTIMIZER is for ddp)")
        if resume_path:
            restore_drafter(c, d, dcfg, resume_path, drafter, opt)
        model = drafter
        if d.n_drafters > 1 and not sharded:
            model = DDP(drafter, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                        process_group=d.drafters)
    if d.flex:
        set_flex_kernel_options(json.loads(c.FLEX_OPTIONS) if c.FLEX_OPTIONS else None)
        with Phase(d, "compile flex_attention (main thread, before worker threads)", watchdog):
            warmup_flex_attention(d.device, d.dtype, dcfg.num_attention_heads, dcfg.num_key_value_heads,
                                  dcfg.head_dim, dcfg.block_size, mask_lengths(dcfg, d.device, d.flex, c))
    return drafter, model, opt, embed, head_w


def shard_drafter(d, drafter) -> None:
    """DRAFTER_SHARDING=fsdp: FSDP2 over the drafter ranks, one unit per drafter.shard_units() (its decoder layers,
    DFlash2's selector) and the root (fc, hidden_norm, norm), so each rank keeps 1/D of the fp32 weights, gradients and AdamW state. On
    a GPU the forward runs on bf16 all-gathered weights (DTYPE); gradients are reduce-scattered in fp32.
    cast_forward_inputs off: the activations keep the dtypes the drafter's code gives them (fp32 RoPE tables, norms),
    as under DDP and autocast."""
    mesh = DeviceMesh.from_group(d.drafters, d.device.type)
    mp = MixedPrecisionPolicy(param_dtype=d.dtype if d.device.type == "cuda" else None, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    for unit in drafter.shard_units():
        # a unit past the layers (DFlash2's selector) stays gathered from its forward in the loss to its backward:
        # the loss's metrics read it in between
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=any(unit is layer for layer in drafter.layers))
    fully_shard(drafter, mesh=mesh, mp_policy=mp)


def restore_drafter(c, d, dcfg, resume_path, drafter, opt) -> None:
    """A checkpoint's weights, optimizer and RNG into this run's drafter, whatever wrote it: a sharded checkpoint
    (DCP) onto any number of drafter ranks, sharded or whole; a DDP checkpoint's state.pt whole, or into the
    shards through a whole copy on the CPU."""
    try:
        if ckpt.is_sharded(resume_path):
            state = ckpt.load_shards(resume_path, drafter, opt, d.drafters)
        else:
            state = ckpt.load_state(resume_path, map_location=d.device if c.DRAFTER_SHARDING == "ddp" else "cpu")
            if c.DRAFTER_SHARDING == "ddp":
                drafter.load_state_dict(state["drafter"])
                opt.load_state_dict(state["optimizer"])
            else:
                plain = ARCHS[c.DRAFTER_ARCH].drafter(dcfg)
                plain_opt = make_optimizer(plain, c.LR, c.WEIGHT_DECAY)
                plain.load_state_dict(state["drafter"])
                plain_opt.load_state_dict(state["optimizer"])
                ckpt.load_full_into_sharded(drafter, opt, plain, plain_opt)
    except ValueError as e:
        raise SystemExit(f"error: the optimizer state in {resume_path} does not match this drafter's "
                         f"parameters ({e}); it was written for another drafter shape "
                         f"(NUM_DRAFT_LAYERS, TARGET_LAYER_IDS or the target). Resume with the settings "
                         f"that wrote it, or start over in another OUT_DIR") from e
    ckpt.restore_rng(state)


def start_feed(c, d, data, sched, target, dcfg, watchdog, pre_stats):
    """The drafter side's Prefetcher: prepared micro-batches Q_HS ahead, from the network (a drafter rank) or from the
    target forward (the one process; its q_pre depth goes to pre_stats). The one process runs an eager target on
    the feeder thread, which launches its kernels beside the main thread's (a small target is launch-bound), and a
    compiled one on the main thread a micro-batch ahead (TargetAhead: compiled code must not run on one thread while
    another compiles)."""
    prep = make_prepare(dcfg, d.device, d.flex, c)
    if d.colocated:
        packets = produce(data, sched.target_gs(0), target, d.device, c.Q_PREFETCH, stats=pre_stats)
        if c.COMPILE_TARGET:
            log(f"[rank {d.rank} {d.role}] COMPILE_TARGET: the target forward runs on the main thread, a micro-batch "
                f"ahead of the step; the feeder thread prepares")
            feed = TargetAhead(packets, prep, d.device, c.Q_HS)
        else:
            feed = Prefetcher(packets, prep, d.device, c.Q_HS, name="feeder")
    else:
        schedule = ((g, sched.producer(g)) for g in sched.drafter_gs(d.drafter_index))
        packets = receive(schedule, d.ctrl, d.data, d.device, watchdog)
        feed = Prefetcher(packets, prep, d.device, c.Q_HS, name="receiver", fail=watchdog.fail)
        watchdog.state = "waiting for the first micro-batch (queues filling)"
    feed.start()
    return feed
