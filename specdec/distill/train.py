"""Train one or more drafts on target-generated data, with the target's soft labels computed online.

Loss per answer position t (weights: 1 on answer tokens, `prompt_weight` on prompt tokens, 0 on pad):
    kd_weight * KL(target(.|x<t) || draft(.|x<t))  +  ce_weight * -log draft(x_t | x<t)
The KL term is the token-level forward KL of knowledge distillation (Hinton et al., 2015; for speculative
decoding, DistillSpec, Zhou et al., 2023); the target's distribution is recomputed on the GPU for each
batch rather than stored (49,152 probabilities a token would not fit through any transfer). The hard term
is the target's own token, which for greedy answers is its argmax: exactly what greedy acceptance counts.
Several drafts can train on the same batches, sharing one target forward (a size sweep for the price of
one run). Deterministic under a seed; resumable from `out_dir/state.pt`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.distill.data import Record, epoch_batches, load_dir, load_shard, split_holdout
from specdec.distill.draft import DEFAULT_DRAFT, DraftSpec, build_draft, num_parameters, save_draft
from specdec.distill.evaluate import match_vectors, summarize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    data_dir: str
    out_dir: str
    target: str | None = None  # None: hard labels only (no soft labels)
    drafts: tuple[str, ...] = (DEFAULT_DRAFT,)
    eval_file: str | None = None  # held-out reference answers (specdec distill make-eval); never trained on
    max_steps: int = 1000  # 0 with time_budget_s: the schedule runs on elapsed time instead of steps
    time_budget_s: float = 0.0
    reload_data: bool = False  # rescan data_dir at each epoch (a generator still writing shards)
    first_shard_wait_s: float = 900.0  # with reload_data: how long to wait for the generator's first shard
    stop_at_step: int = 0  # save and stop after this step, keeping the schedule (split a run across sessions)
    init_from: str | None = None  # an HF draft directory to start from (same shape as the one draft trained)
    batch_tokens: int = 16384
    max_len: int = 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.05
    kd_weight: float = 1.0
    ce_weight: float = 0.5
    prompt_weight: float = 0.1
    seed: int = 0
    log_every: int = 10
    eval_every: int = 500
    save_every: int = 500
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    holdout_every: int = 100
    extra: dict = field(default_factory=dict)


def lr_at(cfg: TrainConfig, step: int, max_steps: int, elapsed_s: float = 0.0) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio over the steps, or over the time budget when
    max_steps is 0 (then the schedule depends on wall time and a run is not bit-reproducible)."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    if max_steps > 0:
        progress = min(1.0, step / max_steps)
    else:
        progress = min(1.0, elapsed_s / max(cfg.time_budget_s, 1e-9))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_batch(records: list[Record], idx: list[int], max_len: int, prompt_weight: float):
    """Right-padded ids [B, T], attention mask [B, T], per-position loss weights [B, T-1] (position t
    predicts token t+1)."""
    lens = [min(len(records[i].tokens), max_len) for i in idx]
    width = max(lens)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros(len(idx), width, dtype=torch.long)
    weights = torch.zeros(len(idx), width - 1)
    for row, (i, n) in enumerate(zip(idx, lens)):
        r = records[i]
        ids[row, :n] = torch.from_numpy(r.tokens[:n])
        mask[row, :n] = 1
        weights[row, :n - 1] = prompt_weight
        weights[row, max(r.prompt_len - 1, 0):n - 1] = 1.0
    return ids, mask, weights


def distill_loss(
    draft_logits: torch.Tensor,  # [N, V]
    target_logprobs: torch.Tensor | None,  # [N, V] fp32, or None for hard labels only
    target_probs: torch.Tensor | None,  # [N, V] fp32, target_logprobs.exp() (computed once per batch)
    labels: torch.Tensor,  # [N]
    weights: torch.Tensor,  # [N]
    kd_weight: float, ce_weight: float,
) -> tuple[torch.Tensor, dict]:
    logprobs = F.log_softmax(draft_logits.float(), dim=-1)
    ce = -logprobs.gather(-1, labels[:, None]).squeeze(-1)
    per_pos = ce_weight * ce
    stats = {"ce": ce}
    if target_logprobs is not None:
        kl = (target_probs * (target_logprobs - logprobs)).sum(-1)
        per_pos = per_pos + kd_weight * kl
        stats["kl"] = kl
    total = weights.sum().clamp(min=1e-9)
    return (per_pos * weights).sum() / total, {k: float((v.detach() * weights).sum() / total) for k, v in stats.items()}


class Trainer:
    def __init__(self, cfg: TrainConfig, target=None, tokenizer=None):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = cfg.device
        self.target = target
        self.tokenizer = tokenizer
        self._load_data()
        self.eval_records = load_shard(cfg.eval_file) if cfg.eval_file else []
        self.specs = [DraftSpec.parse(s) for s in cfg.drafts]
        if target is None:
            raise ValueError("a target model is needed (its embedding initialises the draft)")
        self.drafts = {s.name: build_draft(target, s, cfg.seed).to(self.device) for s in self.specs}
        if cfg.init_from:
            self._init_from(cfg.init_from)
        self.optims = {
            name: torch.optim.AdamW(d.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
            for name, d in self.drafts.items()
        }
        self.step, self.epoch, self.batch_in_epoch, self.tokens_seen = 0, 0, 0, 0
        self.max_steps = cfg.max_steps
        self.elapsed = 0.0
        if (self.out / "state.pt").exists():
            self._load_state()

    def _init_from(self, path: str) -> None:
        """Start from a trained draft's weights (a resumed run's state.pt still takes precedence)."""
        from transformers import LlamaForCausalLM

        if len(self.drafts) != 1:
            raise ValueError("--init-from starts one draft; give exactly one --draft")
        (name, draft), = self.drafts.items()
        source = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        mine, theirs = draft.config, source.config
        fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads")
        differ = [f"{f} {getattr(theirs, f)} (want {getattr(mine, f)})" for f in fields
                  if getattr(mine, f) != getattr(theirs, f)]
        if differ:
            raise ValueError(f"{path} is not a {name} draft: " + ", ".join(differ))
        draft.load_state_dict(source.state_dict())
        log.info("%s starts from %s", name, path)

    def _load_data(self) -> None:
        records = load_dir(self.cfg.data_dir)
        # A generator started beside the trainer (--reload-data) has written nothing yet: its first shard
        # comes within minutes, and the wait is not charged to the time budget (that clock starts in train()).
        if not records and self.cfg.reload_data:
            log.info("waiting up to %.0f s for the first shard in %s", self.cfg.first_shard_wait_s, self.cfg.data_dir)
            deadline = time.monotonic() + self.cfg.first_shard_wait_s
            while not records and time.monotonic() < deadline:
                time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
                records = load_dir(self.cfg.data_dir)
        if not records:
            raise FileNotFoundError(f"no shard-*.npz files in {self.cfg.data_dir}")
        self.train_records, self.held_records = split_holdout(records, self.cfg.holdout_every)
        self.lengths = [min(len(r.tokens), self.cfg.max_len) for r in self.train_records]

    # -- checkpointing -------------------------------------------------------------------------------
    def _save_state(self) -> None:
        state = {
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "tokens_seen": self.tokens_seen, "max_steps": self.max_steps, "elapsed": self.elapsed,
            "drafts": {n: d.state_dict() for n, d in self.drafts.items()},
            "optims": {n: o.state_dict() for n, o in self.optims.items()},
            "torch_rng": torch.get_rng_state(),
            "config": asdict(self.cfg),
        }
        tmp = self.out / "state.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "state.pt")
        for name, d in self.drafts.items():
            save_draft(d, self.tokenizer, self.out / name, self._meta(name))

    def _load_state(self) -> None:
        state = torch.load(self.out / "state.pt", map_location=self.device, weights_only=False)
        for n, d in self.drafts.items():
            d.load_state_dict(state["drafts"][n])
            self.optims[n].load_state_dict(state["optims"][n])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.tokens_seen, self.max_steps, self.elapsed = state["tokens_seen"], state["max_steps"], state["elapsed"]
        torch.set_rng_state(state["torch_rng"].cpu())
        log.info("resumed at step %d (epoch %d, batch %d)", self.step, self.epoch, self.batch_in_epoch)

    def _meta(self, name: str) -> dict:
        return {"draft": name, "parameters": num_parameters(self.drafts[name]), "step": self.step,
                "train_tokens_seen": self.tokens_seen, "train_records": len(self.train_records),
                "config": {k: v for k, v in asdict(self.cfg).items() if k != "extra"}}

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        result = {}
        for name, d in self.drafts.items():
            entry = {}
            if self.eval_records:
                entry["eval"] = summarize(self.eval_records, match_vectors(d, self.eval_records, self.device))
            if self.held_records:
                held = summarize(self.held_records, match_vectors(d, self.held_records, self.device))
                entry["heldout_generated"] = held["overall_tokens"]
            result[name] = entry
            d.train()
        return result

    def _log(self, entry: dict) -> None:
        with open(self.out / "train_log.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    # -- training ------------------------------------------------------------------------------------
    def _batches(self):
        while True:
            if self.cfg.reload_data and self.batch_in_epoch == 0:
                self._load_data()
                log.info("epoch %d: %d training records", self.epoch, len(self.train_records))
            batches = epoch_batches(self.lengths, self.cfg.batch_tokens, self.cfg.seed, self.epoch)
            while self.batch_in_epoch < len(batches):
                yield batches[self.batch_in_epoch]
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def _target_logprobs(self, ids, mask, sel) -> torch.Tensor | None:
        if self.cfg.kd_weight == 0:
            return None
        with torch.no_grad(), self._autocast():
            hidden = self.target.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][sel]
            logits = self.target.lm_head(hidden)
        return F.log_softmax(logits.float(), dim=-1)

    def _autocast(self):
        if str(self.device).startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def train_step(self, idx: list[int]) -> dict:
        ids, mask, weights = make_batch(self.train_records, idx, self.cfg.max_len, self.cfg.prompt_weight)
        ids, mask, weights = ids.to(self.device), mask.to(self.device), weights.to(self.device)
        sel = weights > 0
        labels, w = ids[:, 1:][sel], weights[sel]
        target_lp = self._target_logprobs(ids, mask, sel)
        target_p = target_lp.exp() if target_lp is not None else None
        lr = lr_at(self.cfg, self.step, self.max_steps, self.elapsed)
        stats = {}
        answer = w == 1.0
        for name, d in self.drafts.items():
            with self._autocast():
                hidden = d.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][sel]
                logits = d.lm_head(hidden)
            loss, parts = distill_loss(logits, target_lp, target_p, labels, w, self.cfg.kd_weight, self.cfg.ce_weight)
            opt = self.optims[name]
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
            opt.step()
            hits = (logits.detach().argmax(-1) == labels)[answer]
            agree = float(hits.float().mean()) if hits.numel() else 0.0
            stats[name] = {"loss": float(loss.detach()), **parts, "agree_train": agree}
        self.tokens_seen += int(mask.sum())
        return {"lr": lr, **stats}

    def train(self) -> dict:
        cfg = self.cfg
        if self.max_steps <= 0 and cfg.time_budget_s <= 0:
            raise ValueError("give max_steps, or max_steps=0 with a time budget")
        for d in self.drafts.values():
            d.train()
        run_schedule(self, self.max_steps, "train", lambda: {"eval": self.evaluate()})
        final = {"step": self.step, "tokens": self.tokens_seen, "elapsed_s": round(self.elapsed, 1),
                 "eval": self.evaluate(), "final": True}
        self._log(final)
        self._save_state()
        return final


def run_schedule(trainer, max_steps: int, desc: str, eval_fields) -> bool:
    """The step loop both trainers share (this module's Trainer and train_head's HeadTrainer): train
    step after step until max_steps (0: none), the time budget or cfg.stop_at_step, logging every
    log_every steps, evaluating (eval_fields(): the fields it logs) every eval_every and saving every
    save_every. The trainer carries cfg, step, epoch, batch_in_epoch, tokens_seen and elapsed (which
    resuming restores), _batches(), train_step(), _log() and _save_state(). True: it stopped at
    stop_at_step."""
    cfg = trainer.cfg
    start = time.time() - trainer.elapsed
    bar = tqdm(total=max_steps if max_steps > 0 else None, initial=trainer.step, desc=desc, mininterval=5)
    batches = trainer._batches()
    try:
        while max_steps <= 0 or trainer.step < max_steps:
            if cfg.stop_at_step and trainer.step >= cfg.stop_at_step:
                log.info("stopping at step %d as asked; resume continues the schedule", trainer.step)
                return True
            if cfg.time_budget_s and time.time() - start > cfg.time_budget_s:
                log.info("time budget reached at step %d", trainer.step)
                return False
            stats = trainer.train_step(next(batches))
            trainer.batch_in_epoch += 1
            trainer.step += 1
            trainer.elapsed = time.time() - start
            bar.update(1)
            if trainer.step % cfg.log_every == 0 or trainer.step == 1:
                trainer._log({"step": trainer.step, "epoch": trainer.epoch, "tokens": trainer.tokens_seen,
                              "elapsed_s": round(trainer.elapsed, 1), **stats})
                bar.set_postfix({n: round(s["agree_train"], 3) for n, s in stats.items() if isinstance(s, dict)})
            if cfg.eval_every and trainer.step % cfg.eval_every == 0:
                trainer._log({"step": trainer.step, "tokens": trainer.tokens_seen, **eval_fields()})
            if cfg.save_every and trainer.step % cfg.save_every == 0:
                trainer._save_state()
        return False
    finally:
        bar.close()


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
