"""The helpers every family shares beside the seam: the config.json reader (families/hparams.py) and
the seeded-draw policy (families/draws.py). Each config.json problem is one line naming the key."""

from __future__ import annotations

import math

import pytest
import torch

from recurrent_coreai.families import draws
from recurrent_coreai.families.hparams import HParams, json_float
from recurrent_coreai.util.errors import PipelineError


def line(fn) -> PipelineError:
    with pytest.raises(PipelineError) as exc:
        fn()
    assert "\n" not in str(exc.value)
    return exc.value


def reader(cfg, **kw) -> HParams:
    return HParams(cfg, "config.json", "use a good config.json", **kw)


# --- hparams ------------------------------------------------------------------------------------------
def test_typed_values_with_defaults_and_spellings():
    r = reader({"n_layer": 4, "hidden_size": 2.0, "eps": 1e-6, "tie": True, "ratio": None, "x": "y"})
    assert r.whole("num_hidden_layers", "n_layer") == 4             # the second spelling
    assert r.whole("hidden_size") == 2 and type(r.whole("hidden_size")) is int
    assert r.whole("head_dim", default=64) == 64                     # absent: the default
    assert r.number("ratio", default=4.0) == 4.0                     # null: the default
    assert r.number("eps") == 1e-6 and r.flag("tie") is True and r.flag("other", default=False) is False
    assert r.value("x") == "y" and r.value("nothing", default=3) == 3
    assert r.has("n_layer") and not r.has("ratio") and not r.has("nothing")


@pytest.mark.parametrize("cfg,call,what,fix", [
    ({}, lambda r: r.whole("num_hidden_layers"), "missing key 'num_hidden_layers'", "use a good config.json"),
    ({}, lambda r: r.whole("n_layer", "num_hidden_layers"), "missing key 'n_layer' (or 'num_hidden_layers')",
     "use a good config.json"),
    ({"num_hidden_layers": None}, lambda r: r.whole("num_hidden_layers"),
     "num_hidden_layers must be a positive integer, got null", "fix num_hidden_layers in config.json"),
    ({"n_layer": 0}, lambda r: r.whole("num_hidden_layers", "n_layer"), "n_layer must be a positive integer, got 0",
     "fix n_layer in config.json"),
    ({"h": 2.5}, lambda r: r.whole("h"), "h must be a positive integer, got 2.5", "fix h in config.json"),
    ({"h": True}, lambda r: r.whole("h"), "h must be a positive integer, got true", "fix h in config.json"),
    ({"e": "abc"}, lambda r: r.number("e", default=1.0), 'e must be a positive number, got "abc"', "fix e in config.json"),
    ({"e": float("inf")}, lambda r: r.number("e"), "e must be a positive number, got Infinity", "fix e in config.json"),
    ({"t": 1}, lambda r: r.flag("t", default=False), "t must be true or false, got 1", "fix t in config.json"),
    ({"use_bias": True}, lambda r: r.require("use_bias", lambda v: v is False, False, "use_bias false"),
     "use_bias is true; this Toy port supports only use_bias false", "extend the toy"),
    ({"a": 1, "zz": 2}, lambda r: r.only({"a"}, "toy config key"), "unknown toy config key 'zz'", "use a good config.json"),
    ({"ssm_cfg": []}, lambda r: r.section("ssm_cfg"), "ssm_cfg is a JSON array, not an object", "use a good config.json"),
    ({"ssm_cfg": {"d": -1}}, lambda r: r.section("ssm_cfg").whole("d"), "ssm_cfg.d must be a positive integer, got -1",
     "fix ssm_cfg.d in config.json"),
    ({"ssm_cfg": {}}, lambda r: r.section("ssm_cfg").whole("d"), "missing key ssm_cfg.'d'", "use a good config.json"),
    ({"ssm_cfg": {"b": 1}}, lambda r: r.section("ssm_cfg").only({"a"}), "unknown key ssm_cfg.'b'", "use a good config.json"),
])
def test_each_problem_is_one_line_naming_the_key(cfg, call, what, fix):
    err = line(lambda: call(reader(cfg, port="Toy", port_fix="extend the toy")))
    assert (err.where, err.what, err.fix) == ("config.json", what, fix)


def test_a_config_that_is_not_an_object_is_one_line():
    err = line(lambda: reader([1]))
    assert err.what == "is a JSON array, not an object"


def test_json_float_reads_every_spelling():
    assert json_float(1) == 1.0 and json_float(math.inf) == math.inf
    assert json_float({"__float__": "Infinity"}) == math.inf and json_float({"__float__": "-Infinity"}) == -math.inf
    assert json_float("inf") is None and json_float(True) is None and json_float({"__float__": "x"}) is None


# --- draws --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_chunked_normal_draws_what_one_call_draws(dtype):
    for n in [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 1000]:
        one, chunked = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
        want = torch.randn((n,), generator=one, dtype=dtype).mul(0.7).float()
        assert torch.equal(draws.chunked_normal((n,), 0.7, chunked, dtype, chunk=32), want), (dtype, n)
        assert torch.equal(torch.rand(4, generator=one), torch.rand(4, generator=chunked)), (dtype, n)


def test_draws_are_float64_cast_once_and_follow_one_generator():
    d, gen = draws.Draws(11), torch.Generator().manual_seed(11)
    assert torch.equal(d.normal((3, 5), 0.5), (torch.randn((3, 5), generator=gen, dtype=torch.float64) * 0.5).float())
    assert torch.equal(d.uniform((7,), -1.0, 2.0),
                       (torch.rand((7,), generator=gen, dtype=torch.float64) * 3.0 - 1.0).float())
    lu = d.log_uniform((9,), 1e-3, 1e-1, exact=True)
    want = torch.exp(torch.rand((9,), generator=gen, dtype=torch.float64) * (math.log(1e-1) - math.log(1e-3))
                     + math.log(1e-3))
    assert lu.dtype == torch.float64 and torch.equal(lu, want) and bool(((lu >= 1e-3) & (lu < 1e-1)).all())
    assert d.normal((2,), exact=True).dtype == torch.float64 and d.uniform((2,), 0, 1).dtype == torch.float32
    assert draws.Draws(11, torch.float32).normal((2,), exact=True).dtype == torch.float32
    with pytest.raises(ValueError):
        draws.Draws(1, torch.float16)
