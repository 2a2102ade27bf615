"""`specdec distill`: train a draft for a target by self-distillation (see docs/DISTILLATION.md).

    specdec distill generate-data --target T --out data/        # the target writes prompts and answers
    specdec distill make-eval --target T --prompts dev.jsonl --out eval.npz   # held-out references
    specdec distill train --target T --data data/ --out run/ [--eval eval.npz]
    specdec distill evaluate --draft run/h256-l3-i768-kv2 --eval eval.npz
    specdec distill cost --draft D --target T                   # CPU decode step, draft vs target
    specdec distill train-head --target T --data data/ --out run/ [--eval eval.npz]   # EAGLE-style head
    specdec distill evaluate-head --head run/head --target T --eval eval.npz [--draft D]
    specdec distill cost-head --target T [--head run/head]     # CPU head step vs target step
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace

log = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _position_edges(text: str) -> list[int]:
    """'1024,1280' -> [1024, 1280]: positive, increasing positions."""
    try:
        edges = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positions such as 1024,1280, got {text!r}")
    if not edges or edges[0] <= 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise argparse.ArgumentTypeError(f"positions must be positive and increasing, got {text!r}")
    return edges


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("distill", help="train a draft model for a target (self-distillation)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
    add_subcommands(parser)


# The default draft shape (specdec.distill.draft.DEFAULT_DRAFT), spelled out here so that building
# the CLI parser doesn't import torch and transformers (`specdec --help` stays instant).
DEFAULT_DRAFT = "h256-l3-i768-kv2"


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="distill_command", metavar="STEP")

    g = sub.add_parser("generate-data", help="target-generated prompts and answers, one shard per chunk")
    g.add_argument("--target", required=True, help="target: HF directory, .gguf file or registry name")
    g.add_argument("--out", required=True, help="output directory for shard-*.npz")
    g.add_argument("--seeds", default=None, help="seed corpus JSON (default: the project's own)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chunks", type=int, default=1)
    g.add_argument("--first-chunk", type=int, default=0)
    g.add_argument("--prompts-per-chunk", type=int, default=2048)
    g.add_argument("--batch-size", type=int, default=512)
    g.add_argument("--max-batch-tokens", type=int, default=512 * 640)
    g.add_argument("--max-user-tokens", type=int, default=96)
    g.add_argument("--max-answer-tokens", type=int, default=320)
    g.add_argument("--max-passage-answer-tokens", type=int, default=256)
    g.add_argument("--passage-fraction", type=float, default=0.35,
                   help="passage tasks (summarize, RAG, extract...) per chunk, relative to --prompts-per-chunk")
    g.add_argument("--summary-passages", type=int, default=1,
                   help="a summarization task joins 1 to this many answers into one document")
    g.add_argument("--time-budget", type=float, default=0.0, help="seconds; no new chunk starts after it")
    _device_args(g, default_dtype="bfloat16")
    g.set_defaults(func=_generate_data)

    e = sub.add_parser("make-eval", help="the target's greedy answers to held-out Spec-Bench-format prompts")
    e.add_argument("--target", required=True)
    e.add_argument("--prompts", required=True, help="jsonl with question_id, category, turns")
    e.add_argument("--out", required=True, help="output .npz")
    e.add_argument("--max-new-tokens", type=int, default=256)
    _device_args(e, default_dtype="float32")
    e.set_defaults(func=_make_eval)

    t = sub.add_parser("train", help="train drafts with online soft labels from the target")
    t.add_argument("--target", required=True)
    t.add_argument("--data", required=True, help="directory of shard-*.npz (generate-data)")
    t.add_argument("--out", required=True, help="run directory: state.pt, train_log.jsonl, one HF dir per draft")
    t.add_argument("--draft", action="append", default=None,
                   help=f"draft size spec, repeatable (default {DEFAULT_DRAFT})")
    t.add_argument("--init-from", default=None,
                   help="start from this draft's weights (HF directory or registry name) instead of the target's "
                        "projected embedding: continue training a shipped draft on new data")
    t.add_argument("--eval", default=None, help="held-out reference answers (make-eval), for the learning curve")
    t.add_argument("--max-steps", type=int, default=1000)
    t.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds; with --max-steps 0 the LR schedule follows elapsed time")
    t.add_argument("--stop-at-step", type=int, default=0,
                   help="save and stop after this step; rerun with the same --out to continue the schedule")
    t.add_argument("--reload-data", action="store_true",
                   help="rescan --data at each epoch (train while generate-data still writes shards); "
                        "waits up to 15 minutes for the first shard")
    t.add_argument("--batch-tokens", type=int, default=16384)
    t.add_argument("--max-len", type=int, default=1024)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup-steps", type=int, default=100)
    t.add_argument("--kd-weight", type=float, default=1.0)
    t.add_argument("--ce-weight", type=float, default=0.5)
    t.add_argument("--prompt-weight", type=float, default=0.1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--save-every", type=int, default=500)
    _device_args(t, default_dtype="bfloat16")
    t.set_defaults(func=_train)

    v = sub.add_parser("evaluate", help="agreement and speculative acceptance per category")
    v.add_argument("--draft", required=True, help="draft HF directory or registry name")
    v.add_argument("--eval", required=True, help="reference answers (make-eval)")
    v.add_argument("--k", type=int, default=4, help="draft tokens per speculative step")
    v.add_argument("--head-vocab", type=int, nargs="*", default=[],
                   help="also score reduced heads of the N most frequent answer tokens (one or more N; the "
                        "draft's head_vocab.json unless --head-data), alone and with the session's context tokens")
    v.add_argument("--head-data", default=None, help="shards whose answer-token counts pick the reduced head")
    v.add_argument("--head-out", default=None, help="write each reduced head's token ids to PREFIX.N.json")
    v.add_argument("--copy-below", type=float, default=None,
                   help="also score each head with the services' copy rule at this threshold (their default: "
                        "0.5): where the draft is unsure, the token that followed the same 3 tokens earlier")
    v.add_argument("--answer-tokens", type=_non_negative, default=0,
                   help="score only the first N tokens of each reference answer (0: all). Long answers often "
                        "end in loops a copying draft predicts well: the first 128 tokens read lower")
    v.add_argument("--by-position", type=_position_edges, default=[], metavar="EDGES",
                   help="also give each variant's agreement per category by the answer token's absolute "
                        "position, in buckets split at these comma-separated positions (e.g. 1024,1280)")
    v.add_argument("--json-out", default=None)
    _device_args(v, default_dtype="float32")
    v.set_defaults(func=_evaluate)

    c = sub.add_parser("cost", help="CPU decode-step time of draft and target (batch 1), and their ratio")
    c.add_argument("--draft", required=True, help="draft HF directory or registry name")
    c.add_argument("--target", required=True, help="target HF directory or registry name")
    c.add_argument("--backend", default="native", choices=("native", "hf"))
    c.add_argument("--context", type=int, default=300)
    c.add_argument("--repeats", type=int, default=40)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--head-vocab", type=int, default=None,
                   help="also time the draft with this reduced head (default: the size its head_vocab.json "
                        "recommends, if any)")
    c.add_argument("--context-rows", type=int, default=150,
                   help="context tokens outside the reduced head scored beside it each step (150: the 90th "
                        "percentile over the Spec-Bench dev sessions at 4,096 rows; docs/DISTILLATION.md)")
    c.set_defaults(func=_cost)

    f = sub.add_parser("to-fp8", help="store a draft's matrices in float8: half the bytes, the same loaders "
                                      "(specdec/distill/fp8.py)")
    f.add_argument("--draft", required=True, help="draft HF directory or registry name (Llama, tied embedding)")
    f.add_argument("--out", required=True, help="directory of the float8 copy")
    f.set_defaults(func=_to_fp8)
    _add_head_subcommands(sub)


def _add_head_subcommands(sub) -> None:
    h = sub.add_parser("train-head", help="train an EAGLE-style draft head on the target's hidden states")
    h.add_argument("--target", required=True)
    h.add_argument("--data", required=True, help="directory of shard-*.npz (generate-data)")
    h.add_argument("--out", required=True, help="run directory: state.pt, train_log.jsonl, head/")
    h.add_argument("--eval", default=None, help="held-out reference answers (make-eval), for the learning curve")
    h.add_argument("--max-steps", type=int, default=1000)
    h.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds; with --max-steps 0 the LR schedule follows elapsed time")
    h.add_argument("--batch-tokens", type=int, default=16384)
    h.add_argument("--max-len", type=int, default=1024)
    h.add_argument("--passes", type=int, default=3,
                   help="chained drafting steps trained per position on the head's own features (1: none)")
    h.add_argument("--pass-decay", type=float, default=0.8, help="loss weight of pass p: decay ** (p - 1)")
    h.add_argument("--lr", type=float, default=1e-3)
    h.add_argument("--warmup-steps", type=int, default=100)
    h.add_argument("--kd-weight", type=float, default=1.0)
    h.add_argument("--ce-weight", type=float, default=0.5)
    h.add_argument("--reg-weight", type=float, default=0.1, help="smooth L1 between predicted and true features")
    h.add_argument("--feature", default="post_norm", choices=("post_norm", "pre_norm"),
                   help="the target's final hidden state after its final norm (EAGLE's) or before it")
    h.add_argument("--prompt-weight", type=float, default=0.1)
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--log-every", type=int, default=10)
    h.add_argument("--eval-every", type=int, default=500)
    h.add_argument("--save-every", type=int, default=500)
    _device_args(h, default_dtype="bfloat16")
    h.set_defaults(func=_train_head)

    e = sub.add_parser("evaluate-head", help="chained speculative acceptance of a draft head per category")
    e.add_argument("--head", required=True, help="head directory (train-head's OUT/head)")
    e.add_argument("--target", required=True)
    e.add_argument("--eval", required=True, help="reference answers (make-eval)")
    e.add_argument("--k", type=int, default=4)
    e.add_argument("--draft", default=None, help="also a standalone draft through the same metrics (baseline)")
    e.add_argument("--combine", action="store_true",
                   help="with --draft: also the two drafting together, the more confident proposing, alone and "
                        "with the copy rule (specdec.distill.combined)")
    e.add_argument("--json-out", default=None)
    _device_args(e, default_dtype="float32")
    e.set_defaults(func=_evaluate_head)

    c = sub.add_parser("cost-head", help="CPU step time of a draft head against a target decode step (plain PyTorch)")
    c.add_argument("--target", required=True)
    c.add_argument("--head", default=None, help="head directory (default: a random head of the target's shape)")
    c.add_argument("--head-rows", type=int, nargs="*", default=[0, 4096],
                   help="lm_head rows scored by the head (0: all); one timing each")
    c.add_argument("--context", type=int, default=300)
    c.add_argument("--repeats", type=int, default=40)
    c.add_argument("--threads", type=int, default=1)
    c.set_defaults(func=_cost_head)


def _device_args(p: argparse.ArgumentParser, default_dtype: str) -> None:
    import torch

    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=default_dtype, choices=_DTYPES, help="target weights' dtype")


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _generate_data(args) -> int:
    from specdec.distill.batched_llama import BatchedLlama
    from specdec.distill.generate import GenerateConfig, generate_data
    from specdec.distill.prompts import load_seeds
    from specdec.distill.target import load_target, load_tokenizer

    cfg = GenerateConfig(
        out_dir=args.out, seed=args.seed, chunks=args.chunks, first_chunk=args.first_chunk,
        prompts_per_chunk=args.prompts_per_chunk, batch_size=args.batch_size,
        max_batch_tokens=args.max_batch_tokens, max_user_tokens=args.max_user_tokens,
        max_answer_tokens=args.max_answer_tokens, max_passage_answer_tokens=args.max_passage_answer_tokens,
        time_budget_s=args.time_budget, passage_fraction=args.passage_fraction,
        summary_passages=args.summary_passages,
    )
    target = load_target(args.target, args.device, _dtype(args.dtype))
    stats = generate_data(BatchedLlama(target), load_tokenizer(args.target), load_seeds(args.seeds), cfg)
    print(json.dumps({"chunks": len(stats), "tokens": sum(s["total_tokens"] for s in stats)}))
    return 0


def _make_eval(args) -> int:
    from specdec.distill.batched_llama import BatchedLlama
    from specdec.distill.generate import generate_eval_set
    from specdec.distill.target import load_target, load_tokenizer

    target = load_target(args.target, args.device, _dtype(args.dtype))
    records = generate_eval_set(BatchedLlama(target), load_tokenizer(args.target), args.prompts, args.out,
                                args.max_new_tokens)
    print(json.dumps({"records": len(records), "answer_tokens": int(sum(len(r.tokens) - r.prompt_len for r in records))}))
    return 0


def _train(args) -> int:
    from specdec.distill.draft import DEFAULT_DRAFT
    from specdec.distill.target import load_target, load_tokenizer
    from specdec.distill.train import TrainConfig, Trainer, set_seed

    set_seed(args.seed)
    cfg = TrainConfig(
        data_dir=args.data, out_dir=args.out, target=args.target, drafts=tuple(args.draft or [DEFAULT_DRAFT]),
        eval_file=args.eval, max_steps=args.max_steps, time_budget_s=args.time_budget, reload_data=args.reload_data,
        stop_at_step=args.stop_at_step, init_from=_resolved_draft(args.init_from),
        batch_tokens=args.batch_tokens, max_len=args.max_len, lr=args.lr, warmup_steps=args.warmup_steps,
        kd_weight=args.kd_weight, ce_weight=args.ce_weight, prompt_weight=args.prompt_weight, seed=args.seed,
        log_every=args.log_every, eval_every=args.eval_every, save_every=args.save_every, device=args.device,
    )
    target = load_target(args.target, args.device, _dtype(args.dtype))
    final = Trainer(cfg, target, load_tokenizer(args.target)).train()
    print(json.dumps(final))
    return 0


def _resolved_draft(name: str | None) -> str | None:
    if name is None:
        return None
    from specdec.models.registry import resolve_model

    return str(resolve_model(name))


def _evaluate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.distill.data import load_dir, load_shard
    from specdec.distill.evaluate import by_position, head_vocab, match_vectors
    from specdec.distill.evaluate import summarize as summarize_only
    from specdec.models.registry import resolve_model
    from specdec.proposers.copy_guess import CopyRule

    draft = AutoModelForCausalLM.from_pretrained(resolve_model(args.draft), dtype=_dtype(args.dtype)).to(args.device)
    records = load_shard(args.eval)
    if args.answer_tokens:
        records = [replace(r, tokens=r.tokens[:r.prompt_len + args.answer_tokens]) for r in records]
    copy = CopyRule(args.copy_below) if args.copy_below else None

    def summarize(records, matches, k):
        result = summarize_only(records, matches, k)
        if args.by_position:
            result["by_position"] = by_position(records, matches, args.by_position)
        return result

    result = {"full_head": summarize(records, match_vectors(draft, records, args.device), args.k)}
    if copy is not None:
        result["full_head+copy"] = summarize(records, match_vectors(draft, records, args.device, copy=copy), args.k)
    source = (load_dir(args.head_data) if args.head_data else records) if args.head_vocab else []
    listing = resolve_model(args.draft) / "head_vocab.json"
    for size in args.head_vocab:
        if args.head_data or not listing.is_file():
            ids, coverage = head_vocab(source, size)
        else:  # the draft's own list (what the services load), picked from its training data
            ids, coverage = torch.tensor(sorted(json.loads(listing.read_text())["token_ids"][:size])), float("nan")
        result[f"head_{size}"] = summarize(records, match_vectors(draft, records, args.device, head_ids=ids), args.k)
        result[f"head_{size}"]["train_coverage"] = round(coverage, 4)
        result[f"head_{size}+context"] = summarize(
            records, match_vectors(draft, records, args.device, head_ids=ids, context=True), args.k)
        if copy is not None:  # as the services draft by default on CPU
            result[f"head_{size}+context+copy"] = summarize(
                records, match_vectors(draft, records, args.device, head_ids=ids, context=True, copy=copy), args.k)
        if args.head_out:
            with open(f"{args.head_out}.{size}.json", "w") as f:
                json.dump({"token_ids": ids.tolist(), "coverage": coverage}, f)
    return _report(result, args.json_out)


def _report(result: dict, json_out: str | None) -> int:
    """An evaluation's result: printed, and written to json_out when given."""
    text = json.dumps(result, indent=2)
    if json_out:
        with open(json_out, "w") as f:
            f.write(text)
    print(text)
    return 0


def _to_fp8(args) -> int:
    from safetensors.torch import load_file

    from specdec.distill.fp8 import quantization_error, write_fp8_checkpoint
    from specdec.models.registry import resolve_model

    source = resolve_model(args.draft)
    size = write_fp8_checkpoint(source, args.out)
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    errors = quantization_error(load_file(source / "model.safetensors"), layers)
    print(json.dumps({"source_bytes": (source / "model.safetensors").stat().st_size, "fp8_bytes": size,
                      "relative_rms_error_max": max(errors.values()),
                      "relative_rms_error_mean": sum(errors.values()) / len(errors)}))
    return 0


def _cost(args) -> int:
    import torch

    from specdec.distill.evaluate import decode_step_ms
    from specdec.models.reduced_head import recommended_head_vocab
    from specdec.models.registry import resolve_model

    torch.set_num_threads(args.threads)
    draft = resolve_model(args.draft)
    paths = {"draft": str(draft), "target": str(resolve_model(args.target))}
    rows = args.head_vocab or recommended_head_vocab(draft)
    heads = {}
    if rows and args.backend == "native":
        # As served (the compiled step), and through PyTorch's operators for comparison.
        for name in (f"draft_head{rows}", f"draft_head{rows}_pytorch"):
            paths[name] = str(draft)
            heads[name] = (rows, args.context_rows)
    fused = frozenset(n for n in paths if n.startswith("draft") and not n.endswith("_pytorch"))
    result = decode_step_ms(paths, args.backend, args.context, args.repeats, heads=heads, fused=fused)
    for name in (n for n in paths if n != "target"):
        for stat in ("median_ms", "min_ms"):
            result[name][f"ratio_{stat[:-3]}"] = round(result[name][stat] / result["target"][stat], 4)
    print(json.dumps({"backend": args.backend, "threads": args.threads, "context": args.context,
                      "context_rows": args.context_rows, **result}))
    return 0


def _train_head(args) -> int:
    from specdec.distill.target import load_target
    from specdec.distill.train import set_seed
    from specdec.distill.train_head import HeadTrainConfig, HeadTrainer

    set_seed(args.seed)
    cfg = HeadTrainConfig(
        data_dir=args.data, out_dir=args.out, target_name=args.target, feature=args.feature, eval_file=args.eval,
        max_steps=args.max_steps, time_budget_s=args.time_budget, batch_tokens=args.batch_tokens,
        max_len=args.max_len, passes=args.passes, pass_decay=args.pass_decay, lr=args.lr,
        warmup_steps=args.warmup_steps, kd_weight=args.kd_weight, ce_weight=args.ce_weight,
        reg_weight=args.reg_weight, prompt_weight=args.prompt_weight, seed=args.seed, log_every=args.log_every,
        eval_every=args.eval_every, save_every=args.save_every, device=args.device,
    )
    final = HeadTrainer(cfg, load_target(args.target, args.device, _dtype(args.dtype))).train()
    print(json.dumps(final))
    return 0


def _evaluate_head(args) -> int:
    from specdec.distill.data import load_shard
    from specdec.distill.evaluate import match_vectors
    from specdec.distill.evaluate_head import baseline_chains, chain_summary, chains_of, head_predictions
    from specdec.distill.head import load_head
    from specdec.distill.target import load_target

    target = load_target(args.target, args.device, _dtype(args.dtype))
    head = load_head(args.head).to(args.device, _dtype(args.dtype)).attach(target)
    records = load_shard(args.eval)
    head_preds = head_predictions(head, target, records, args.k, args.device)
    result = {"head": chain_summary(records, chains_of(records, head_preds, args.k), args.k)}
    if args.draft:
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(_resolved_draft(args.draft), dtype=_dtype(args.dtype))
        matches = match_vectors(draft.to(args.device), records, args.device)
        result["draft"] = chain_summary(records, baseline_chains(matches, args.k), args.k)
        if args.combine:
            from specdec.distill.combined import combined_chains, draft_predictions
            from specdec.proposers.copy_guess import CopyRule

            draft_preds = draft_predictions(draft, records, args.device)
            for name, copy in (("head+draft", None), ("head+draft+copy", CopyRule())):
                chains = combined_chains(records, head_preds, draft_preds, args.k, copy)
                result[name] = chain_summary(records, chains, args.k)
    return _report(result, args.json_out)


def _cost_head(args) -> int:
    import torch

    from specdec.distill.evaluate_head import head_step_ms
    from specdec.distill.head import DraftHead, HeadConfig, load_head, num_parameters
    from specdec.distill.target import load_target

    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    if args.head:
        head = load_head(args.head, target)
    else:
        torch.manual_seed(0)  # the cost does not depend on the weights
        head = DraftHead(HeadConfig.from_target(target.config, args.target)).attach(target)
    result = {"threads": args.threads, "context": args.context, "head_parameters": num_parameters(head.eval())}
    for rows in args.head_rows:
        times = head_step_ms(head, target, args.context, args.repeats, head_rows=rows or None)
        times["ratio_median"] = round(times["head"]["median_ms"] / times["target"]["median_ms"], 4)
        result[f"rows_{rows or 'all'}"] = times
    print(json.dumps(result))
    return 0
