"""The medium benchmark size and `benchmarks/stepcache_bench.py` (`make bench`).

The medium configs must be the full-size models' transformers with fewer
layers: every width, head count and head dim as published (the catalog's facts
and the registry's configs), checked on modules built under FakeTensorMode (no
weights allocated). The bench itself runs here as a dry run: the tiny models,
same code path, every family, policy and threshold, sequence parallel 2 included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

torch = require_module("torch")
require_module("diffusers")

from helpers import REPO  # noqa: E402
from videojob.catalog import Family, get_model  # noqa: E402
from videojob_runtime.configs import (  # noqa: E402
    MEDIUM_SIZES,
    component_configs,
    instantiate_component,
    medium_component_configs,
    medium_model,
)

# What a medium size may change: sequence lengths and the depth, nothing wide.
SEQUENCE_KEYS = {"num_layers", "max_text_seq_length", "sample_width", "sample_height", "sample_frames"}


def test_the_three_families_have_a_medium_size():
    families = {get_model(m).family for m in MEDIUM_SIZES}
    assert families == {Family.COGVIDEOX, Family.WAN, Family.CONSISID}


@pytest.mark.parametrize("model_id", sorted(MEDIUM_SIZES))
def test_medium_transformer_is_the_full_one_with_fewer_layers(model_id):
    size, model = MEDIUM_SIZES[model_id], get_model(model_id)
    full = component_configs(model_id)["transformer"].config
    medium = medium_component_configs(model_id)["transformer"].config
    assert {k: v for k, v in medium.items() if k not in SEQUENCE_KEYS} == \
        {k: v for k, v in full.items() if k not in SEQUENCE_KEYS}
    assert medium["num_layers"] == size.layers < full["num_layers"] == model.arch.layers
    # The catalog's facts (heads, head dim) hold for the medium config too.
    assert medium["num_attention_heads"] == model.attention_heads
    assert medium["attention_head_dim"] == model.arch.head_dim
    # The job fits the family's rules, and CogVideoX-style SP (height split) gets even patch rows.
    assert model.frames.accepts(size.frames)
    assert size.width % model.size_multiple == 0 and size.height % model.size_multiple == 0
    assert (size.height // (model.arch.vae_spatial * model.arch.patch_hw)) % 2 == 0
    if "max_text_seq_length" in medium:
        assert medium["max_text_seq_length"] == size.text_tokens
        assert medium["sample_width"] * model.arch.vae_spatial == size.width
    # What the planner reads for a medium job: the catalog entry with the medium depth and prompt.
    mm = medium_model(model_id)
    assert (mm.arch.layers, mm.arch.text_tokens) == (size.layers, size.text_tokens)
    assert (mm.attention_heads, mm.arch.head_dim, mm.caches) == (model.attention_heads, model.arch.head_dim,
                                                                  model.caches)


@pytest.mark.parametrize("model_id", sorted(MEDIUM_SIZES))
def test_medium_modules_have_the_published_widths(model_id):
    """Built (fake tensors): attention heads x head dim, the text and latent
    widths the transformer reads from the tiny encoder and VAE."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = get_model(model_id)
    comps = medium_component_configs(model_id)
    with FakeTensorMode():
        tr = instantiate_component(comps["transformer"], "float32")
        te = instantiate_component(comps["text_encoder"], "float32")
        vae = instantiate_component(comps["vae"], "float32")
    blocks = getattr(tr, "transformer_blocks", None) or tr.blocks
    assert len(blocks) == MEDIUM_SIZES[model_id].layers
    attn = blocks[0].attn1
    hidden = model.attention_heads * model.arch.head_dim
    assert attn.heads == model.attention_heads
    assert attn.to_q.out_features == hidden and attn.to_q.in_features == hidden
    full = component_configs(model_id)
    text_width = full["transformer"].config.get("text_embed_dim") or full["transformer"].config["text_dim"]
    assert te.config.d_model == text_width
    latent = full["vae"].config.get("latent_channels") or full["vae"].config["z_dim"]
    assert (vae.config.get("latent_channels") or vae.config["z_dim"]) == latent == model.arch.latent_channels
    assert tr.config.out_channels == latent


def test_medium_size_refuses_what_it_does_not_cover():
    with pytest.raises(KeyError, match="no medium size"):
        medium_component_configs("cogvideox-5b")
    from videojob_runtime.pipelines import load_pipeline

    with pytest.raises(ValueError, match="size must be"):
        load_pipeline("tiny-cogvideox", "t2v", "float32", size="large")


# Medium-size models for about 40 s: in `make test-slow`; `make bench` runs the benchmark itself.
@pytest.mark.slow
def test_stepcache_bench_dry_run(tmp_path):
    """The bench's code path end to end on the tiny models (well under a minute)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import stepcache_bench as bench

    out, png = tmp_path / "stepcache.json", tmp_path / "stepcache.png"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "stepcache_bench.py"), "--dry-run", "--out", str(out),
         "--png", str(png), "--sp-family", "cogvideox-2b"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert len(doc["commit"]) == 40 and doc["machine"]["cores"] > 0
    assert doc["command"].startswith("python benchmarks/stepcache_bench.py") and doc["dryRun"] is True
    assert png.stat().st_size > 10_000
    tiny = {full: tiny for full, tiny in bench.FAMILIES}
    assert [f["model"] for f in doc["families"]] == [tiny[m] for m, _ in bench.FAMILIES]
    for fam in doc["families"]:
        model = get_model(fam["model"])
        policies = [c for c in model.caches if c not in ("off", "auto")]
        expected = [("off", None)] + [(p, t) for p in policies for t in bench.THRESHOLDS[(fam["family"], p)]]
        assert [(r["policy"], r["threshold"]) for r in fam["rows"]] == expected
        assert 0.0 < fam["profile"]["transformerShareOfDenoise"] <= 1.0
        for r in fam["rows"]:
            assert r["speedup"] > 0 and len(r["denoiseSeconds"]) == doc["setup"]["repeats"]
            assert 0.0 <= r["skippedFraction"] < 1.0
            assert r["denoiserCalls"] == len(r["skipPattern"]) == doc["setup"]["steps"] * \
                model.denoiser_calls_per_step(fam["size"]["guidance"])
            assert r["sameOutputEveryRepeat"]
            for q in (r["latents"], r["frames"]):
                # Identical to cache off exactly when nothing was skipped.
                assert q["bitIdentical"] == (r["blockEvaluationsSkipped"] == 0), r
                assert q["bitIdentical"] or (q["psnrDb"] > 0 and q["maxAbsError"] > 0)
            if r["policy"] == "off":
                assert r["cacheBytesMeasured"] == 0 and r["cacheBytesPlanned"] == 0
            else:
                assert r["cacheBytesMeasured"] > 0 and r["cacheBytesPlanned"] > 0
        assert fam["auto"]["benchChoice"]["policy"] in ["off"] + policies
        assert fam["auto"]["runtimeToday"]["policy"] in policies
    sp = doc["sequenceParallel"]
    assert sp["ranks"] == 2 and all(c > 0 for c in sp["collectivesPerRank"])
    assert [r["policy"] for r in sp["rows"]] == ["off", "dbcache", "teacache"]
    assert all(r["ranksAgree"] for r in sp["rows"])
    assert all(r["blockEvaluationsSkipped"] > 0 for r in sp["rows"][1:]), "SP rows must exercise skipping"
