"""Train an EAGLE-style draft head (specdec.distill.head) on target-generated shards.

The target runs online on every batch (no grad) and gives, for each position, its feature f_t (its final
hidden state; head.py says which) and its next-token distribution. The head is unrolled over `passes`
chained drafting steps (EAGLE-3's training-time test, Li et al., 2025): pass 1 reads the true features,
pass p > 1 reads the head's own predictions from pass p-1, with the attention context it would have at
drafting time (head.unrolled).
So steps 2..k of a drafting step are trained on the features they will actually see, instead of on true
features plus noise (EAGLE-1's remedy; not used here). Loss of pass p at base t, which scores x_{t+p+1}:

    KL(target(.|x<=t+p) || head)  +  ce_weight * -log head(x_{t+p+1})  +  reg_weight * smoothL1(g, f_{t+p})

(forward KL on soft labels as in specdec.distill.train; the feature regression is EAGLE's), weighted 1 on
answer tokens and `prompt_weight` on prompt tokens, and pass p by pass_decay ** (p - 1). Deterministic
under a seed with --max-steps; resumable from out_dir/state.pt; the schedule follows elapsed time with
--max-steps 0 --time-budget S.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec.distill.data import epoch_batches, load_dir, load_shard, split_holdout
from specdec.distill.evaluate_head import chain_summary, head_chains, target_features
from specdec.distill.head import DraftHead, HeadConfig, num_parameters, save_head
from specdec.distill.train import lr_at, make_batch, run_schedule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadTrainConfig:
    data_dir: str
    out_dir: str
    target_name: str = ""  # recorded in the head's config
    feature: str = "post_norm"  # the target's hidden state after its final norm, or "pre_norm" (head.py)
    eval_file: str | None = None
    max_steps: int = 1000  # 0 with time_budget_s: the schedule follows elapsed time
    time_budget_s: float = 0.0
    stop_at_step: int = 0  # save and stop after this step, keeping the schedule (a run split across calls)
    batch_tokens: int = 16384
    max_len: int = 1024
    passes: int = 3  # chained drafting steps trained per position (1: no training-time test)
    pass_decay: float = 0.8
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.0
    kd_weight: float = 1.0
    ce_weight: float = 0.5
    reg_weight: float = 0.1
    prompt_weight: float = 0.1
    eval_k: int = 4
    seed: int = 0
    log_every: int = 10
    eval_every: int = 500
    save_every: int = 500
    holdout_every: int = 100
    device: str = "cuda" if torch.cuda.is_available() else "cpu"


def head_loss(head: DraftHead, features: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              target_logprobs: torch.Tensor, rows: torch.Tensor, cfg: HeadTrainConfig) -> tuple[torch.Tensor, dict]:
    """features: [B, T, H] true pre-norm features; ids: [B, T]; weights: [B, T-1] (position t scores
    x_{t+1}); target_logprobs: [N, V], the target's log-distribution at the N positions where weights > 0;
    rows: [B, T-1] the row of each such position in target_logprobs (-1 elsewhere)."""
    b, t = ids.shape
    pad = ids.new_zeros(b, cfg.passes - 1)
    outputs = head.unrolled(features[:, :t - 1], torch.cat([ids[:, 1:], pad], dim=1), cfg.passes)
    total, norm, stats = 0.0, 0.0, {}
    for p, out in enumerate(outputs, start=1):
        if t - 1 - p <= 0:
            break
        w = weights[:, p:]  # [B, T-1-p] the weight of x_{t+p+1}, scored from base t
        valid = w > 0
        g = out[:, :t - 1 - p][valid]  # [n, H]
        logprobs = F.log_softmax(head.logits(g).float(), dim=-1)
        teacher = target_logprobs[rows[:, p:][valid]]  # [n, V]
        labels = ids[:, p + 1:][valid]
        kl = (teacher.exp() * (teacher - logprobs)).sum(-1)
        ce = -logprobs.gather(-1, labels[:, None]).squeeze(-1)
        reg = F.smooth_l1_loss(g.float(), features[:, p:t - 1][valid].float(), reduction="none").mean(-1)
        wv = w[valid]
        denom = wv.sum().clamp(min=1e-9)
        loss_p = (wv * (cfg.kd_weight * kl + cfg.ce_weight * ce + cfg.reg_weight * reg)).sum() / denom
        scale = cfg.pass_decay ** (p - 1)
        total, norm = total + scale * loss_p, norm + scale
        answer = wv == 1.0
        hits = (logprobs.detach().argmax(-1) == labels)[answer]
        stats[f"p{p}"] = {"loss": float(loss_p.detach()), "kl": float((wv * kl.detach()).sum() / denom),
                          "reg": float((wv * reg.detach()).sum() / denom),
                          "agree_train": float(hits.float().mean()) if hits.numel() else 0.0}
    return total / max(norm, 1e-9), stats


class HeadTrainer:
    def __init__(self, cfg: HeadTrainConfig, target):
        self.cfg, self.target, self.device = cfg, target.eval(), cfg.device
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        records = load_dir(cfg.data_dir)
        if not records:
            raise FileNotFoundError(f"no shard-*.npz files in {cfg.data_dir}")
        self.train_records, self.held_records = split_holdout(records, cfg.holdout_every)
        self.lengths = [min(len(r.tokens), cfg.max_len) for r in self.train_records]
        self.eval_records = load_shard(cfg.eval_file) if cfg.eval_file else []
        torch.manual_seed(cfg.seed)  # the head's initial weights depend on the seed only
        head_config = HeadConfig.from_target(target.config, cfg.target_name, cfg.feature)
        self.head = DraftHead(head_config).to(self.device).attach(target)
        self.optim = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                       weight_decay=cfg.weight_decay)
        self.step, self.epoch, self.batch_in_epoch, self.tokens_seen, self.elapsed = 0, 0, 0, 0, 0.0
        if (self.out / "state.pt").exists():
            self._load_state()

    def _save_state(self) -> None:
        state = {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                 "tokens_seen": self.tokens_seen, "elapsed": self.elapsed, "head": self.head.state_dict(),
                 "optim": self.optim.state_dict(), "torch_rng": torch.get_rng_state(), "config": asdict(self.cfg)}
        torch.save(state, self.out / "state.pt.tmp")
        (self.out / "state.pt.tmp").replace(self.out / "state.pt")
        save_head(self.head, self.out / "head", {"step": self.step, "train_tokens_seen": self.tokens_seen,
                                                  "parameters": num_parameters(self.head), "config": asdict(self.cfg)})

    def _load_state(self) -> None:
        state = torch.load(self.out / "state.pt", map_location=self.device, weights_only=False)
        self.head.load_state_dict(state["head"])
        self.optim.load_state_dict(state["optim"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.tokens_seen, self.elapsed = state["tokens_seen"], state["elapsed"]
        torch.set_rng_state(state["torch_rng"].cpu())
        log.info("resumed at step %d (epoch %d, batch %d)", self.step, self.epoch, self.batch_in_epoch)

    def _log(self, entry: dict) -> None:
        with open(self.out / "train_log.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(self.device).startswith("cuda"))

    def _batches(self):
        while True:
            batches = epoch_batches(self.lengths, self.cfg.batch_tokens, self.cfg.seed, self.epoch)
            while self.batch_in_epoch < len(batches):
                yield batches[self.batch_in_epoch]
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def train_step(self, idx: list[int]) -> dict:
        cfg = self.cfg
        ids, mask, weights = (x.to(self.device) for x in make_batch(self.train_records, idx, cfg.max_len,
                                                                    cfg.prompt_weight))
        sel = weights > 0
        rows = torch.full_like(weights, -1, dtype=torch.long)
        rows[sel] = torch.arange(int(sel.sum()), device=self.device)
        with torch.no_grad(), self._autocast():
            pre_norm, normed = target_features(self.target, ids, mask)
            features = self.head.pick(pre_norm, normed)
            target_logprobs = F.log_softmax(self.target.lm_head(normed[:, :-1][sel]).float(), dim=-1)
        with self._autocast():
            loss, stats = head_loss(self.head, features, ids, weights, target_logprobs, rows, cfg)
        lr = lr_at(cfg, self.step, cfg.max_steps, self.elapsed)
        for group in self.optim.param_groups:
            group["lr"] = lr
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optim.step()
        self.tokens_seen += int(mask.sum())
        return {"lr": lr, "loss": float(loss.detach()), **stats}

    def evaluate(self) -> dict:
        result = {}
        with self._autocast():
            if self.eval_records:
                chains = head_chains(self.head, self.target, self.eval_records, self.cfg.eval_k, self.device)
                result["eval"] = chain_summary(self.eval_records, chains, self.cfg.eval_k)
            if self.held_records:
                chains = head_chains(self.head, self.target, self.held_records, self.cfg.eval_k, self.device)
                held = chain_summary(self.held_records, chains, self.cfg.eval_k)
                result["heldout_generated"] = held["overall_tokens"]
        self.head.train()
        return result

    def train(self) -> dict:
        cfg = self.cfg
        if cfg.max_steps <= 0 and cfg.time_budget_s <= 0:
            raise ValueError("give max_steps, or max_steps=0 with a time budget")
        self.head.train()
        if run_schedule(self, cfg.max_steps, "train-head", self.evaluate):  # stopped at stop_at_step
            self._save_state()
            return {"step": self.step, "stopped": True}
        final = {"step": self.step, "tokens": self.tokens_seen, "elapsed_s": round(self.elapsed, 1),
                 **self.evaluate(), "final": True}
        self._log(final)
        self._save_state()
        return final


def losses_of(log_path: str | Path) -> np.ndarray:
    """The logged total losses of a run, in step order (tests and quick looks)."""
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines()]
    return np.array([r["loss"] for r in rows if "loss" in r])
