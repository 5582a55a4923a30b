"""Tests for editrain.models.llama: shapes, maths, init and trainability."""

import math

import pytest
import torch

from editrain.models import (
    PRESETS,
    Llama,
    LlamaConfig,
    causal_lm_loss,
    num_parameters,
    preset_config,
)
from editrain.models.llama import Attention, RMSNorm, apply_rope, precompute_rope


def _tokens(b: int, t: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g)


def test_forward_shape_tiny():
    cfg = preset_config("tiny")
    model = Llama(cfg, seed=0)
    logits = model(_tokens(2, 16, cfg.vocab_size))
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert len(model.blocks()) == cfg.n_layers
    assert all(a is b for a, b in zip(model.blocks(), model.layers))


def test_parameter_counts():
    # Meta device: counting needs shapes only, so the big presets cost nothing.
    with torch.device("meta"):
        tiny = Llama(preset_config("tiny", vocab_size=8192))
        small = Llama(preset_config("small", vocab_size=8192))
        untied = Llama(preset_config("tiny", vocab_size=8192, tie_embeddings=False))
        big = {n: Llama(preset_config(n)) for n in ("350m", "1b", "3b", "7b")}
    assert num_parameters(tiny) < 1_000_000
    assert 2_000_000 < num_parameters(small) < 10_000_000
    cfg = tiny.config
    assert num_parameters(untied) - num_parameters(tiny) == cfg.vocab_size * cfg.dim
    # The GPU presets should land near their nominal sizes.
    for name, nominal in (("350m", 350e6), ("1b", 1e9), ("3b", 3e9), ("7b", 7e9)):
        assert 0.8 * nominal < num_parameters(big[name]) < 1.2 * nominal, name


def test_num_parameters_counts_shared_once():
    lin = torch.nn.Linear(4, 4, bias=False)
    seq = torch.nn.Sequential(lin, lin)
    assert num_parameters(seq) == 16


def test_tied_model_has_no_output_module():
    tied = Llama(preset_config("tiny", vocab_size=64), seed=0)
    assert tied.output is None
    names = [n for n, _ in tied.named_parameters()]
    assert not any(n.startswith("output") for n in names)
    untied = Llama(preset_config("tiny", vocab_size=64, tie_embeddings=False), seed=0)
    assert untied.output is not None
    # RoPE tables are derived from the config and must stay out of checkpoints.
    assert not any("rope" in k for k in tied.state_dict())


def test_causality():
    cfg = preset_config("tiny", vocab_size=256)
    model = Llama(cfg, seed=0).eval()
    tokens = _tokens(2, 24, cfg.vocab_size)
    t = 11
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        a = model(tokens)
        b = model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t], b[:, t])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def _naive_attention(attn: Attention, x: torch.Tensor, theta: float) -> torch.Tensor:
    """Reference attention: explicit loops, complex-number RoPE, explicit mask."""
    b, t, _ = x.shape
    h, k, e = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = (x @ attn.wq.weight.T).view(b, t, h, e)
    kk = (x @ attn.wk.weight.T).view(b, t, k, e)
    v = (x @ attn.wv.weight.T).view(b, t, k, e)

    # Independent RoPE formulation: channel i and i + E/2 form the complex
    # number (x_i + j x_{i+E/2}), multiplied by exp(j * pos * freq_i).
    freqs = theta ** (-torch.arange(0, e, 2, dtype=torch.float64) / e)
    phase = torch.polar(
        torch.ones(t, e // 2, dtype=torch.float64),
        torch.arange(t, dtype=torch.float64)[:, None] * freqs[None, :],
    )  # [T, E/2]

    def rope(z):
        c = torch.complex(z[..., : e // 2], z[..., e // 2 :]) * phase[None, :, None, :]
        return torch.cat([c.real, c.imag], dim=-1)

    q, kk = rope(q), rope(kk)
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    group = h // k
    heads = []
    for head in range(h):
        kv = head // group  # query head -> its shared kv head
        scores = q[:, :, head] @ kk[:, :, kv].transpose(-1, -2) / math.sqrt(e) + mask
        heads.append(torch.softmax(scores, dim=-1) @ v[:, :, kv])  # [B, T, E]
    out = torch.stack(heads, dim=2).reshape(b, t, h * e)
    return out @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_matches_naive(n_kv_heads):
    cfg = LlamaConfig(
        vocab_size=32,
        dim=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        ffn_hidden=64,
        max_seq_len=16,
        rope_theta=500.0,
    )
    torch.manual_seed(0)
    attn = Attention(cfg).double()
    # Larger-than-init weights make the softmax far from uniform, so a wrong
    # head grouping or mask would change the output noticeably.
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.5)
    t = 7
    x = torch.randn(2, t, cfg.dim, dtype=torch.float64)
    cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, torch.float64)
    with torch.no_grad():
        got = attn(x, cos[:t], sin[:t])
        want = _naive_attention(attn, x, cfg.rope_theta)
    assert got.dtype == torch.float64
    # float64 outputs of order 1, the naive formula in another order: 1e-10 is about a
    # million float64 ulps of slack and still far below a wrong mask or rotation (1e-2)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_rope_relative_position():
    e = 16
    cos, sin = precompute_rope(e, 64, 10000.0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(e, dtype=torch.float64, generator=g)
    k = torch.randn(e, dtype=torch.float64, generator=g)

    def rotated(vec, pos):
        return apply_rope(vec.view(1, 1, 1, e), cos[pos : pos + 1], sin[pos : pos + 1]).view(e)

    def score(m, n):
        return torch.dot(rotated(q, m), rotated(k, n)).item()

    # Same offset m - n = 4 at different absolute positions (float64 scores of order 1,
    # the rotations' sines and cosines rounded at other angles: 1e-10, class 3).
    assert abs(score(9, 5) - score(40, 36)) < 1e-10
    assert abs(score(4, 0) - score(63, 59)) < 1e-10
    # And the score genuinely depends on the offset (guards a no-op rotation).
    assert abs(score(9, 5) - score(9, 6)) > 1e-6
    # A rotation preserves the norm (float64, order 1: a few roundings, class 3).
    assert abs(rotated(q, 37).norm().item() - q.norm().item()) < 1e-12


def test_rmsnorm_exact_value():
    norm = RMSNorm(4, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    # mean of squares = (1 + 4 + 9 + 16) / 4 = 7.5
    scale = 1.0 / math.sqrt(7.5 + 1e-5)
    want = torch.tensor([[1.0 * scale, -4.0 * scale, 1.5 * scale, -4.0 * scale]])
    # float32 against the float64 formula rounded once: the norm's mean, rsqrt and two
    # products round a few times, under 8 ulps (rtol 1e-6) of outputs up to 1.5
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-7)
    # Low-precision input comes back in its own dtype.
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def test_deterministic_init():
    cfg = preset_config("tiny", vocab_size=128)
    a = Llama(cfg, seed=3)
    b = Llama(cfg, seed=3)
    c = Llama(cfg, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    # Re-initialising in place with the same seed reproduces the weights.
    c.init_weights(seed=3)
    assert all(torch.equal(sa[k], c.state_dict()[k]) for k in sa)


def test_init_statistics():
    cfg = preset_config("tiny", vocab_size=128)
    model = Llama(cfg, seed=0)
    blk = model.layers[0]
    wq_std = blk.attention.wq.weight.std().item()
    wo_std = blk.attention.wo.weight.std().item()
    w2_std = blk.feed_forward.w2.weight.std().item()
    scaled = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    assert abs(wq_std - cfg.init_std) < 0.1 * cfg.init_std
    assert abs(wo_std - scaled) < 0.1 * scaled
    assert abs(w2_std - scaled) < 0.1 * scaled
    assert torch.equal(blk.attention_norm.weight, torch.ones(cfg.dim))
    assert torch.equal(model.norm.weight, torch.ones(cfg.dim))


def test_meta_init_then_materialise():
    cfg = preset_config("tiny", vocab_size=128)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    ref = Llama(cfg, seed=5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(model.rope_cos, ref.rope_cos)
    assert torch.equal(model.rope_sin, ref.rope_sin)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(dim=66, n_heads=4), r"dim .*n_heads"),
        (dict(n_heads=4, n_kv_heads=3), r"n_heads .*n_kv_heads"),
        (dict(dim=24, n_heads=8, n_kv_heads=2), r"head_dim"),
        (dict(n_layers=0), r"n_layers"),
        (dict(vocab_size=-5), r"vocab_size"),
        (dict(norm_eps=0.0), r"norm_eps"),
    ],
)
def test_config_validation(overrides, match):
    base = dict(PRESETS["tiny"])
    base.update(overrides)
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**base)


@pytest.mark.parametrize(("overrides", "said"), [
    (dict(n_layers=0), "n_layers: must be >= 1, got 0"),
    (dict(dim=True), "dim: expected an integer, got true"),
    (dict(dim=64.0), "dim: expected an integer, got 64.0"),
    (dict(norm_eps=0.0), "norm_eps: must be > 0, got 0.0"),
    (dict(init_std="0.02"), 'init_std: expected a number, got "0.02"'),
    (dict(tie_embeddings=1), "tie_embeddings: expected true or false, got 1"),
])
def test_config_fields_are_refused_in_the_words_of_every_option(overrides, said):
    """LlamaConfig checked its fields by hand ("dim must be a positive integer, got 0"),
    refusing numpy integers; one check now (errors.plain_scalar / plain_count), the
    config file's option named as model.FIELD."""
    with pytest.raises(ValueError) as e:
        LlamaConfig(**{**PRESETS["tiny"], **overrides})
    assert str(e.value) == said
    if "n_layers" in overrides or "dim" in overrides:  # options of the config's [model]
        from editrain.config import load_config
        from editrain.config.model import model_config

        with pytest.raises(ValueError) as e:
            model_config(load_config(None, {"model": {"preset": "tiny", **overrides}}))
        assert str(e.value) == f"model.{said}"


def test_config_takes_numpy_scalars_as_plain_numbers():
    np = pytest.importorskip("numpy")
    cfg = preset_config("tiny", dim=np.int64(64), n_layers=np.int32(3),
                        vocab_size=np.uint16(300), rope_theta=np.float32(5e5))
    assert (cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.rope_theta) == (64, 3, 300, 5e5)
    assert [type(getattr(cfg, f)) for f in ("dim", "n_layers", "vocab_size", "rope_theta")
            ] == [int, int, int, float]


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match=r'unknown preset "huge".*tiny'):
        preset_config("huge")
    with pytest.raises(ValueError, match=r"dimm"):
        preset_config("tiny", dimm=3)


def test_seq_len_too_long():
    cfg = preset_config("tiny", vocab_size=64, max_seq_len=8)
    model = Llama(cfg, seed=0)
    model(_tokens(1, 8, 64))  # exactly max_seq_len is fine
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(1, 9, 64))


def test_causal_lm_loss():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g).bfloat16()
    targets = torch.randint(0, 5, (2, 3), generator=g)
    loss = causal_lm_loss(logits, targets)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    logp = torch.log_softmax(logits.float(), dim=-1)
    want = -logp.gather(-1, targets[..., None]).mean()
    # float32 defaults (rtol 1.3e-6, 11 ulps): the same log-softmax in another kernel
    torch.testing.assert_close(loss, want)


def test_overfits_single_batch():
    cfg = preset_config("tiny")
    model = Llama(cfg, seed=0)
    tokens = _tokens(4, 32, cfg.vocab_size, seed=1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = causal_lm_loss(model(inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
