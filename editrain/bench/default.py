"""Default: the run a new user starts first (``editrain train`` with no options), measured.

The README's quick start promises that ``editrain train`` trains a small Llama on the
embedded corpus in under two minutes on 2 cores; this scenario runs exactly that (every
option at its default: small preset, 2 replicas x 2 shards, 80 steps, ``edit``) and
records the validation loss (at the start over ``train.eval_tokens``, at the end over the
whole held-out split), the time taken and the split itself, so the README's figures come
from a committed result. A second run is the same with ``--sync.method sync`` (every
step's gradients averaged: the same tokens, seed and data order), so the record sets the
default's loss and wall time beside synchronous training's.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.prose import fill, prose
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict
from editrain.config import Config, to_dict

TEXT = prose("default")
SECTIONS = ("model", "data", "train", "optim", "dist", "sync", "sim", "checkpoint")


def defaults() -> dict[str, Any]:
    """Every training option at its default (what ``editrain train`` alone runs)."""
    cfg = to_dict(Config())
    out = {name: cfg[name] for name in SECTIONS}
    del out["data"]["cache_dir"]  # where the cache lives changes no result: the user's wins
    return out


def _last(bench: Any) -> dict[str, Any]:
    """Applied last, over the benchmark's base options: the defaults themselves. The tiny
    size (tests) only shortens the run."""
    last = defaults()
    if bench.mode == "tiny":
        last["train"].update(steps=4, eval_every=2, warmup_steps=1, eval_tokens=2048,
                             final_eval_tokens=2048)
        last["model"]["preset"] = "tiny"
        last["data"].update(max_bytes=300_000, vocab_size=512, val_tokens=4096)
    return last


def _results(ctx: Ctx) -> dict[str, Any]:
    out = {"default": _run_result(ctx.runs["default"])}
    if ctx.runs["default"].ok:
        out["default"]["split"] = _split_facts(ctx.runs["default"])
    out["sync"] = _run_result(ctx.runs["sync"])
    d, s = out["default"]["final_val_loss"], out["sync"]["final_val_loss"]
    out["default"]["vs_sync"] = (d - s) / s if d is not None and s else None
    return out


def _run_result(r: Any) -> dict[str, Any]:
    """One run's losses, sizes and times."""
    tokens, train_s = r.summary.get("tokens"), r.summary.get("train_time_s")
    return {"ok": r.ok, "error": r.error, "initial_val_loss": r.initial_val_loss,
            "final_val_loss": r.final_val_loss, "val_tokens": r.summary.get("val_tokens"),
            "initial_val_tokens": r.evals[0].get("val_tokens") if r.evals else None,
            "tokens": tokens, "steps": r.summary.get("steps"),
            "wall_time_s": r.summary.get("wall_time_s"), "train_time_s": train_s,
            "launch_s": r.launch_s,
            "eval_time_s": sum(e.get("eval_time_s") or 0.0 for e in r.evals),
            "evaluations": len(r.evals),
            "tokens_per_s": tokens / train_s if tokens and train_s else None}


def _split_facts(r: Any) -> dict[str, Any]:
    """The split of the run's corpus, read back from its token cache (no tokenising)."""
    from editrain.config import load_config
    from editrain.corpus import describe_data, prepare_data

    cfg = load_config(r.run_dir / "config.toml")
    info = describe_data(prepare_data(cfg))
    return {k: info[k] for k in ("documents", "split", "val_train_overlap", "overlap_window",
                                 "tokenizer_trained_on")} | {
        "train_tokens": info["train"]["tokens"], "val_tokens": info["val"]["tokens"]}


def _headline(ctx: Ctx) -> Verdict:
    result = ctx.results["default"]
    if not result["ok"] or result["final_val_loss"] is None or ctx.bench.mode == "tiny":
        return Verdict()
    overlap = (result.get("split") or {}).get("val_train_overlap")
    return Verdict(headline=[fill(
        TEXT["headline"], r=result, minutes=result["launch_s"] / 60,
        overlap="" if overlap is None else fill(TEXT["overlap"], overlap=overlap),
        # "; synchronous training ..." on the same tokens, nothing when that run failed
        vs_sync="" if result.get("vs_sync") is None else fill(
            TEXT["vs_sync"], r=result, sync=ctx.results["sync"],
            minutes=ctx.results["sync"]["launch_s"] / 60))])


SCENARIO = Scenario(
    name="default",
    description=TEXT["description"],
    setup=lambda bench: {"last": _last(bench)},
    runs=lambda ctx: [Job("default", title="editrain train (defaults)", last=ctx.last),
                      # The options that apply to local SGD only are left out by the
                      # bench, as editrain train would refuse them.
                      Job("sync", title="the same, synchronous",
                          last={**ctx.last, "sync": {**ctx.last["sync"], "method": "sync"}})],
    measure=_results, judge=_headline, size_caveat=False,
    tables=[Table("The default run, and the same in synchronous mode", [
        ("run", None), ("val loss at start", "initial_val_loss"), ("final val loss", "final_val_loss"),
        ("val tokens at start", "initial_val_tokens"), ("final val tokens", "val_tokens"),
        ("steps", "steps"), ("tokens", "tokens"), ("evaluations", "evaluations"),
        ("wall s (launch)", "launch_s"), ("train s", "train_time_s"),
        ("eval s", "eval_time_s"), ("tokens/s (train)", "tokens_per_s")])],
    settings=lambda ctx: {"options": "defaults", "steps": ctx.results["default"]["steps"]},
    methods=lambda ctx: ["edit", "sync"],
    notes=lambda ctx: fill(TEXT["notes"], cfg=Config()),
)
