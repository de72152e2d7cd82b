"""The Mamba-1 reference against mamba_ssm's own pure-torch reference ops: ``selective_scan_ref``
(the whole sequence), ``selective_state_update_ref`` (one token) and ``rms_norm_ref`` (the fused
add + norm of its blocks), on the ``mamba-ssm`` layout (pytorch_model.bin + mamba_ssm's config.json)
read back through the family's reader.

mamba_ssm does not import on a machine without CUDA: ``mamba_ssm/__init__.py`` imports the triton
kernels and ``ops/selective_scan_interface.py`` imports the compiled ``selective_scan_cuda`` at the
top (docs/mamba1.md#proven-against-the-official-implementations). Its reference functions themselves are plain torch +
einops, so they are taken from the installed source files by name (their ``def`` only, read with
``ast``) and run here. Where mamba_ssm's source is not installed the test is skipped, saying how to
get it (a CUDA-less source build into a throwaway folder)::

    MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE .venv/bin/python -m pip install \\
        --target /tmp/mssm --no-deps --no-build-isolation mamba-ssm==2.3.2.post1
    MAMBA_SSM_SRC=/tmp/mssm .venv/bin/python -m pytest tests/families/test_mamba1_mamba_ssm.py

The glue around the ops (in_proj, the causal conv, x_proj, dt_proj, out_proj, the residual) is
written here from ``mamba_ssm/modules/mamba_simple.py``'s slow path (``Mamba.forward`` without the
fused kernel, ``Mamba.step``) and ``modules/block.py``, not from the family's reference.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mamba1_common import FAMILY, SHAPES, geometry, tokens, weights
from recurrent_coreai.families.mamba1 import layouts

N_TOKENS = 64
TOL = 1e-4
REFS = {"ops/selective_scan_interface.py": "selective_scan_ref",
        "ops/triton/selective_state_update.py": "selective_state_update_ref",
        "ops/triton/layer_norm.py": "rms_norm_ref"}


def mamba_ssm_root() -> Path | None:
    """The installed mamba_ssm package folder ($MAMBA_SSM_SRC/mamba_ssm, else where Python finds it:
    find_spec runs none of its code)."""
    src = os.environ.get("MAMBA_SSM_SRC")
    if src:
        return Path(src) / "mamba_ssm" if (Path(src) / "mamba_ssm").is_dir() else None
    spec = importlib.util.find_spec("mamba_ssm")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


@pytest.fixture(scope="module")
def refs() -> dict:
    root = mamba_ssm_root()
    if root is None:
        pytest.skip("mamba_ssm's source is not installed (see this module's docstring for the CUDA-less build)")
    from einops import rearrange, repeat

    out, ns = {}, {"torch": torch, "F": F, "math": math, "rearrange": rearrange, "repeat": repeat}
    for rel, name in REFS.items():
        tree = ast.parse((root / rel).read_text())
        found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        assert len(found) == 1, f"{root / rel} has no single def {name}"
        exec(compile(ast.Module(body=found, type_ignores=[]), str(root / rel), "exec"), ns)
        out[name] = ns[name]
    return out


def _mixer_sequence(refs, w, p, g, hs):
    """Mamba.forward's slow path over hs [1, L, C]: (out [1, L, C], conv_state [1, I, K], ssm_state [1, I, N])."""
    L, K, R, N = hs.shape[1], g.conv_kernel, g.dt_rank, g.d_state
    xz = (w[p + "in_proj.weight"] @ hs[0].T).unsqueeze(0)                      # [1, 2I, L]
    x, z = xz.chunk(2, dim=1)
    conv_state = F.pad(x, (K - L, 0))                                           # the last K inputs
    x = F.silu(F.conv1d(x, w[p + "conv1d.weight"], w[p + "conv1d.bias"], padding=K - 1, groups=g.intermediate)[..., :L])
    x_dbl = x[0].T @ w[p + "x_proj.weight"].T                                   # [L, R + 2N]
    dt, B, C = torch.split(x_dbl, [R, N, N], dim=-1)
    dt = (w[p + "dt_proj.weight"] @ dt.T).unsqueeze(0)                          # [1, I, L]
    A = -torch.exp(w[p + "A_log"].float())
    y, last = refs["selective_scan_ref"](x, dt, A, B.T.unsqueeze(0).contiguous(), C.T.unsqueeze(0).contiguous(),
                                         w[p + "D"].float(), z=z, delta_bias=w[p + "dt_proj.bias"].float(),
                                         delta_softplus=True, return_last_state=True)
    return (y[0].T @ w[p + "out_proj.weight"].T).unsqueeze(0), conv_state, last


def _mixer_step(refs, w, p, g, h, conv_state, ssm_state):
    """Mamba.step over h [1, C] (the states updated in place): out [1, C]."""
    xz = h @ w[p + "in_proj.weight"].T
    x, z = xz.chunk(2, dim=-1)
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    x = F.silu(torch.sum(conv_state * w[p + "conv1d.weight"][:, 0, :], dim=-1) + w[p + "conv1d.bias"])
    dt, B, C = torch.split(x @ w[p + "x_proj.weight"].T, [g.dt_rank, g.d_state, g.d_state], dim=-1)
    dt = F.linear(dt, w[p + "dt_proj.weight"])
    A = -torch.exp(w[p + "A_log"].float())
    y = refs["selective_state_update_ref"](ssm_state, x, dt, A, B, C, w[p + "D"], z=z, dt_bias=w[p + "dt_proj.bias"],
                                           dt_softplus=True)
    return y @ w[p + "out_proj.weight"].T


def mamba_ssm_run(refs, w, g, toks, step: bool):
    """MambaLMHeadModel's logits [L, V] and states (fused add + RMS norm per block, residual in fp32)."""
    rms = refs["rms_norm_ref"]
    convs = [torch.zeros(1, g.intermediate, g.conv_kernel) for _ in range(g.layers)]
    ssms = [torch.zeros(1, g.intermediate, g.d_state) for _ in range(g.layers)]
    emb, logits = w["backbone.embeddings.weight"], []
    chunks = [[t] for t in toks] if step else [toks]
    for chunk in chunks:
        hidden, residual = emb[torch.tensor(chunk)].unsqueeze(0), None
        for i in range(g.layers):
            p = f"backbone.layers.{i}.mixer."
            normed, residual = rms(hidden, w[f"backbone.layers.{i}.norm.weight"], None, residual=residual,
                                   eps=g.norm_eps, prenorm=True)
            if step:
                hidden = _mixer_step(refs, w, p, g, normed[0], convs[i], ssms[i]).unsqueeze(0)
            else:
                hidden, convs[i], ssms[i] = _mixer_sequence(refs, w, p, g, normed)
        out = rms(hidden, w["backbone.norm_f.weight"], None, residual=residual, eps=g.norm_eps)
        logits.append(out[0] @ w["lm_head.weight"].T)
    return torch.cat(logits), {"convState": torch.stack(convs).numpy(), "ssmState": torch.stack(ssms).numpy()}


@pytest.mark.parametrize("name", [n for n in sorted(SHAPES) if not SHAPES[n].get("falcon")])
def test_reference_matches_mamba_ssm_refs(refs, name, tmp_path):
    g = geometry(name)
    sd = weights(g, seed=4)
    layout = "mamba-ssm" if g.tie_embeddings else "hf"   # mamba_ssm's own files hold a tied head only
    FAMILY.write_layout(sd, tmp_path, layout, geom=g)
    g2, normal, read_as = layouts.read_dir(tmp_path)
    assert (g2, read_as) == (g, layout)
    toks = tokens(N_TOKENS, g.vocab, seed=6)
    ref = FAMILY.reference(normal, g)
    want, state = ref.run(toks)
    states = ref.bundle_states(state)
    with torch.no_grad():
        for step in (False, True):
            logits, got = mamba_ssm_run(refs, normal, g, toks, step)
            d = {"logits": float((logits - want).abs().max())}
            d.update({n: float(np.abs(got[n] - states[n]).max()) for n in states})
            print(f"\nreference vs mamba_ssm {'selective_state_update_ref' if step else 'selective_scan_ref'}, "
                  f"{name}, {N_TOKENS} tokens: {d}")
            assert max(d.values()) < TOL, d


def test_a_broken_glue_is_caught(refs):
    """The comparison can fail: mamba_ssm's ops fed Δ without its softplus differ from the reference."""
    g = geometry("tied-auto")
    sd = weights(g, seed=4)
    toks = tokens(N_TOKENS, g.vocab, seed=6)
    want, _ = FAMILY.reference(sd, g).run(toks)
    broken = dict(refs)
    scan = refs["selective_scan_ref"]
    broken["selective_scan_ref"] = lambda *a, **k: scan(*a, **{**k, "delta_softplus": False})
    with torch.no_grad():
        logits, _ = mamba_ssm_run(broken, sd, g, toks, step=False)
    assert not torch.isfinite(logits).all() or float((logits - want).abs().max()) > 1e-2
