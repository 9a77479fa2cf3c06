"""Tenants apart (issue 21): an operator job's locations resolve in its namespace's directory.

Namespace ``a`` tries every spelling it can write to reach namespace ``b``'s
video (to overwrite it: outputs are renamed into place) and ``b``'s poster
(to read it as an i2v input), with real files under tmp roots and the
runtime's own resolver, loader and writer. Each attempt is either refused
naming the field, or lands in ``a``'s own directory with ``b``'s files
untouched. Then the admin's shared read-only model locations, the chart's
layout (roots inside a claim) and `videojob run`, which keeps the roots as
they are.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import REPO, require_module
from videojob_runtime.errors import JobFailure
from videojob_runtime.inputs import load_image
from videojob_runtime.locations import resolve
from videojob_runtime.output import resolve_location, write_failure

VIDEO, POSTER = b"b's video", b"b's poster"
HOOKS = ("VIDEOJOB_SHARED_MODEL_ROOTS", "VIDEOJOB_INPUT_STAGING_ROOT", "HF_HOME", "HF_HUB_CACHE",
         "VIDEOJOB_S3_CACHE_ROOT", "VIDEOJOB_S3_STAGING_ROOT")


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """The four roots under tmp_path, b's video and poster in each, a's own poster."""
    require_module("PIL")
    paths = {k: tmp_path / k for k in ("outputs", "inputs", "models", "volumes")}
    for env, key in (("VIDEOJOB_OUTPUT_ROOT", "outputs"), ("VIDEOJOB_DATA_ROOT", "inputs"),
                     ("VIDEOJOB_MODEL_ROOT", "models"), ("VIDEOJOB_VOLUMES_ROOT", "volumes")):
        monkeypatch.setenv(env, str(paths[key]))
    for hook in HOOKS:
        monkeypatch.delenv(hook, raising=False)
    for home in (paths["outputs"] / "b/videos", paths["volumes"] / "videos/b/videos"):
        home.mkdir(parents=True)
        (home / "job.mp4").write_bytes(VIDEO)
    for home in (paths["inputs"] / "b", paths["volumes"] / "inputs/b"):
        home.mkdir(parents=True)
        (home / "poster.png").write_bytes(POSTER)
    from PIL import Image

    for home in (paths["inputs"] / "a", paths["volumes"] / "inputs/a"):
        home.mkdir(parents=True)
        Image.new("RGB", (8, 8), (1, 2, 3)).save(home / "own.png")
    return paths


def _b_untouched(roots) -> None:
    for video in (roots["outputs"] / "b/videos/job.mp4", roots["volumes"] / "videos/b/videos/job.mp4"):
        assert video.read_bytes() == VIDEO, video
    for poster in (roots["inputs"] / "b/poster.png", roots["volumes"] / "inputs/b/poster.png"):
        assert poster.read_bytes() == POSTER, poster


# Spellings by which namespace a names b's video directory (outputs) or b's poster (inputs);
# {abs} is the absolute path of b's file, {root} the root's.
SPELLINGS = [
    ("namespace-first-segment", "local://b/videos", "local://b/poster.png"),
    ("claim-then-namespace", "pvc://videos/b/videos", "pvc://inputs/b/poster.png"),
    ("dotdot", "local://../b/videos", "local://../b/poster.png"),
    ("dotdot-inside", "local://x/../../b/videos", "local://x/../../b/poster.png"),
    ("pvc-dotdot", "pvc://videos/../b/videos", "pvc://inputs/../b/poster.png"),
    ("absolute", "local:///{abs}", "local:///{abs}"),
    ("absolute-claim", "pvc:///{abs}", "pvc:///{abs}"),
    ("empty-segment-absolute", "pvc://videos//{abs}", "pvc://inputs//{abs}"),
    ("empty-segment", "local://x//b/videos", "local://x//b/poster.png"),
    ("percent-dotdot", "local://%2e%2e/b/videos", "local://%2e%2e/b/poster.png"),
    ("percent-dotdot-upper", "local://%2E%2E/b/videos", "local://%2E%2E/b/poster.png"),
    ("percent-slash", "local://..%2fb%2fvideos", "local://..%2fb%2fposter.png"),
    ("double-percent", "local://%252e%252e/b/videos", "local://%252e%252e/b/poster.png"),
    ("backslash", "local://x\\..\\..\\b\\videos", "local://x\\..\\..\\b\\poster.png"),
    ("fullwidth-dots", "local://\uff0e\uff0e/b/videos", "local://\uff0e\uff0e/b/poster.png"),
    ("one-dot-leaders", "local://\u2024\u2024/b/videos", "local://\u2024\u2024/b/poster.png"),
    ("fullwidth-solidus", "local://..\uff0fb\uff0fvideos", "local://..\uff0fb\uff0fposter.png"),
    ("zero-width-dots", "local://.\u200b./b/videos", "local://.\u200b./b/poster.png"),
    ("dot-segment", "local://./../b/videos", "local://./../b/poster.png"),
    ("plain-path", "{abs}", "{abs}"),
    ("relative-plain-path", "../b/videos", "../b/poster.png"),
]


def _spell(template: str, target: Path) -> str:
    return template.replace("{abs}", str(target).lstrip("/"), 1) if template != "{abs}" else str(target)


@pytest.mark.parametrize("case, output, _", SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_a_cannot_write_b_s_video_by_any_spelling(roots, case, output, _):
    uri = _spell(output, roots["outputs"] / "b/videos")
    try:
        directory = resolve_location(uri, namespace="a")
    except JobFailure as exc:
        assert exc.details["field"] == "spec.output.uri" and exc.message.startswith("spec.output.uri: "), exc.message
    else:  # it resolved: then inside a's own directory, and writing there leaves b's video alone
        homes = (roots["outputs"].resolve() / "a", roots["volumes"].resolve() / "videos/a")
        assert any(directory.is_relative_to(home) for home in homes), directory
        write_failure(directory, "job", {"ok": False})  # removes job.mp4 there, writes job.json
        assert (directory / "job.json").is_file()
    _b_untouched(roots)


@pytest.mark.parametrize("case, _, image", SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_a_cannot_read_b_s_poster_by_any_spelling(roots, case, _, image):
    uri = _spell(image, roots["inputs"] / "b/poster.png")
    with pytest.raises(JobFailure) as caught:  # refused, or not found in a's own directory
        load_image(uri, 8, 8, "spec.image", namespace="a")
    assert caught.value.details["field"] == "spec.image" and caught.value.message.startswith("spec.image: ")
    assert POSTER.decode() not in caught.value.message
    _b_untouched(roots)


@pytest.mark.parametrize("uri", ["local://own.png", "pvc://inputs/own.png"])
def test_a_reads_its_own_files(roots, uri):
    assert load_image(uri, 4, 4, "spec.image", namespace="a").size == (4, 4)


def test_a_writes_its_own_outputs_under_its_directory(roots):
    assert resolve_location("local://videos/job", namespace="a") == roots["outputs"].resolve() / "a/videos/job"
    assert resolve_location("pvc://videos/job", namespace="a") == roots["volumes"].resolve() / "videos/a/job"
    write_failure(resolve_location("local://b/videos", namespace="a"), "job", {"ok": False})
    assert (roots["outputs"] / "a/b/videos/job.json").is_file()  # a's own directory named b, not b's
    _b_untouched(roots)


def _link(link: Path, to: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(to)


@pytest.mark.parametrize("case", ["dir-link", "relative-dir-link", "file-link", "namespace-dir-is-a-link",
                                  "pvc-dir-link", "link-chain"])
def test_links_from_a_s_tree_into_b_s_are_refused_after_following_them(roots, case):
    inputs, volumes = roots["inputs"], roots["volumes"]
    if case == "dir-link":
        _link(inputs / "a/peek", inputs / "b")
        uri = "local://peek/poster.png"
    elif case == "relative-dir-link":
        _link(inputs / "a/peek", Path("../b"))
        uri = "local://peek/poster.png"
    elif case == "file-link":
        _link(inputs / "a/poster.png", inputs / "b/poster.png")
        uri = "local://poster.png"
    elif case == "namespace-dir-is-a-link":  # a's whole directory is b's
        _link(inputs / "c", inputs / "b")
        with pytest.raises(JobFailure, match=r"^spec.image: 'local://poster.png' resolves to .*outside namespace "
                                             r"c's directory .*put the file itself under that directory"):
            load_image("local://poster.png", 8, 8, "spec.image", namespace="c")
        return
    elif case == "pvc-dir-link":
        _link(volumes / "inputs/a/peek", Path("../b"))
        uri = "pvc://inputs/peek/poster.png"
    else:  # a link inside a's tree to another link inside it, which points out
        _link(inputs / "a/hop2", inputs / "b")
        _link(inputs / "a/hop1", inputs / "a/hop2")
        uri = "local://hop1/poster.png"
    with pytest.raises(JobFailure, match=r"^spec.image: .* resolves to .*outside namespace a's directory") as caught:
        load_image(uri, 8, 8, "spec.image", namespace="a")
    assert caught.value.details["field"] == "spec.image"
    _link(roots["outputs"] / "a/out", roots["outputs"] / "b/videos")
    with pytest.raises(JobFailure, match=r"^spec.output.uri: 'local://out' resolves to .*outside namespace a's"):
        resolve_location("local://out", namespace="a")
    _b_untouched(roots)


def test_links_inside_a_s_own_directory_are_fine(roots):
    _link(roots["inputs"] / "a/alias.png", Path("own.png"))
    assert load_image("local://alias.png", 4, 4, "spec.image", namespace="a").size == (4, 4)


@pytest.mark.parametrize("namespace", ["", "..", "../b", "b/..", "a/b", "B", "-a", "a" * 64, "a\u2024b", "a b"])
def test_a_namespace_that_is_not_a_dns1123_label_is_refused(roots, namespace):
    with pytest.raises(JobFailure, match=r"^spec.image: 'local://own.png': the job's namespace "
                                         r"(is required|.*DNS-1123 label)"):
        resolve("local://own.png", "input", "spec.image", namespace=namespace)


def _models(roots, monkeypatch, shared: str = "pvc://models,local://_shared/") -> dict[str, Path]:
    """Two shared model locations (a whole claim, a directory of the model root), each with a model."""
    monkeypatch.setenv("VIDEOJOB_SHARED_MODEL_ROOTS", shared)
    found = {"pvc://models/cog": roots["volumes"] / "models/cog",
             "local://_shared/cog": roots["models"] / "_shared/cog"}
    for path in found.values():
        path.mkdir(parents=True)
        (path / "model_index.json").write_text("{}")
    return found


def test_the_shared_model_roots_are_read_by_every_namespace(roots, monkeypatch):
    require_module("torch")
    from videojob_runtime.pipelines import resolve_source

    for uri, path in _models(roots, monkeypatch).items():
        for namespace in ("a", "b"):
            assert resolve_source("cogvideox-5b", uri, namespace) == path.resolve()
            assert resolve_source("cogvideox-5b", uri + "/", namespace) == path.resolve()
    # a's own models stay a's: local://cog (not shared) is <model root>/a/cog
    assert resolve("local://cog", "source", "spec.model.source", namespace="a") == roots["models"].resolve() / "a/cog"


@pytest.mark.parametrize("field, kind, uri", [
    ("spec.output.uri", "output", "pvc://models/cog"),
    ("spec.output.uri", "output", "pvc://models/new"),
    ("spec.image", "input", "pvc://models/cog/model_index.json"),
])
def test_no_field_but_the_model_source_reaches_a_shared_claim(roots, monkeypatch, field, kind, uri):
    _models(roots, monkeypatch)
    with pytest.raises(JobFailure, match=rf"^{field}: '{uri}': namespace a's directory .* is the cluster's shared "
                                         r"read-only model location .*name it in spec.model.source only"):
        resolve(uri, kind, field, namespace="a")


def test_an_output_spelled_like_a_shared_directory_stays_in_the_namespace(roots, monkeypatch):
    models = _models(roots, monkeypatch)
    directory = resolve_location("local://_shared/cog", namespace="a")
    assert directory == roots["outputs"].resolve() / "a/_shared/cog"
    write_failure(directory, "job", {"ok": False})
    assert (directory / "job.json").is_file()
    assert [p.name for p in models["local://_shared/cog"].iterdir()] == ["model_index.json"]


def test_a_link_out_of_a_shared_root_is_refused(roots, monkeypatch):
    _models(roots, monkeypatch)
    _link(roots["volumes"] / "models/peek", roots["volumes"] / "videos/b")
    with pytest.raises(JobFailure, match=r"^spec.model.source: 'pvc://models/peek' resolves to .*outside its root"):
        resolve("pvc://models/peek", "source", "spec.model.source", namespace="a")


def test_a_namespace_named_like_a_shared_directory_cannot_use_it_as_its_own(roots, monkeypatch):
    _models(roots, monkeypatch, shared="local://base")
    with pytest.raises(JobFailure, match=r"^spec.model.source: 'local://mine': namespace base's directory .* "
                                         r"shared read-only"):
        resolve("local://mine", "source", "spec.model.source", namespace="base")


@pytest.mark.parametrize("value", ["hf://org/name", "https://example.com/m", "local://../x", "pvc://models//x",
                                   "/mnt/models"])
def test_a_bad_shared_model_root_names_the_variable(roots, monkeypatch, value):
    monkeypatch.setenv("VIDEOJOB_SHARED_MODEL_ROOTS", value)
    with pytest.raises(JobFailure, match=r"^VIDEOJOB_SHARED_MODEL_ROOTS: .*list pvc://CLAIM\[/path\] or "
                                         r"local://path locations"):
        resolve("local://cog", "source", "spec.model.source", namespace="a")


def test_the_chart_layout_keeps_namespaces_out_of_the_other_roots(tmp_path, monkeypatch):
    """The chart mounts its claim at <volumes>/<claim> and puts the roots in it (outputs/, inputs/,
    models/, staging/, huggingface/): a namespace named like one of them must not reach it as pvc://."""
    data = tmp_path / "volumes/data"
    for env, sub in (("VIDEOJOB_OUTPUT_ROOT", "outputs"), ("VIDEOJOB_DATA_ROOT", "inputs"),
                     ("VIDEOJOB_MODEL_ROOT", "models"), ("VIDEOJOB_INPUT_STAGING_ROOT", "staging"),
                     ("HF_HOME", "huggingface")):
        monkeypatch.setenv(env, str(data / sub))
    monkeypatch.setenv("VIDEOJOB_VOLUMES_ROOT", str(tmp_path / "volumes"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("VIDEOJOB_SHARED_MODEL_ROOTS", raising=False)
    # The chart's S3 cache and upload staging, beside the roots (issue 36, 11: missed before).
    monkeypatch.setenv("VIDEOJOB_S3_CACHE_ROOT", str(data / "s3-cache"))
    monkeypatch.setenv("VIDEOJOB_S3_STAGING_ROOT", str(data / "s3-staging"))
    (data / "outputs/b/videos").mkdir(parents=True)
    for namespace, setting in (("outputs", "VIDEOJOB_OUTPUT_ROOT"), ("inputs", "VIDEOJOB_DATA_ROOT"),
                               ("models", "VIDEOJOB_MODEL_ROOT"), ("staging", "VIDEOJOB_INPUT_STAGING_ROOT"),
                               ("huggingface", "HF_HOME/hub"), ("s3-cache", "VIDEOJOB_S3_CACHE_ROOT"),
                               ("s3-staging", "VIDEOJOB_S3_STAGING_ROOT")):
        with pytest.raises(JobFailure, match=rf"^spec.output.uri: 'pvc://data/b/videos': namespace {namespace}'s "
                                             rf"directory .* holds another root \({setting}: .*ask the cluster admin"):
            resolve_location("pvc://data/b/videos", namespace=namespace)
    assert resolve_location("pvc://data/b/videos", namespace="a") == data.resolve() / "a/b/videos"
    assert resolve_location("local://b/videos", namespace="a") == data.resolve() / "outputs/a/b/videos"


def test_a_local_root_that_is_the_volumes_root_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("VIDEOJOB_OUTPUT_ROOT", str(tmp_path))
    monkeypatch.setenv("VIDEOJOB_VOLUMES_ROOT", str(tmp_path))
    for hook in HOOKS:
        monkeypatch.delenv(hook, raising=False)
    with pytest.raises(JobFailure, match=r"^spec.output.uri: 'local://x': the local:// root .* is "
                                         r"VIDEOJOB_VOLUMES_ROOT, so namespace videos's directory would be the claim"):
        resolve_location("local://x", namespace="videos")


def test_videojob_run_keeps_the_roots_as_they_are(roots):
    """No namespace (one user, one machine): local://b/... is <root>/b/..., as before."""
    assert resolve_location("local://b/videos") == roots["outputs"].resolve() / "b/videos"
    assert resolve("local://b/poster.png", "input", "spec.image").read_bytes() == POSTER


def _driver_request(**changes):
    import yaml

    from videojob.api.resource import parse_videojob
    from videojob.driver_protocol import DriverRequest, GroupRequest
    from videojob.jobrequest import job_fields

    job = parse_videojob(yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text()))
    layout = {"offload": "none", "vaeTiling": False, "vaeSlicing": False, "fp8Weights": False,
              "decodeOffload": False, "cache": "off"}
    fields = job_fields(job, layout, "tiny-cpu", "tiny-cpu", seed=0)
    return DriverRequest(namespace="a", name="tiny-cpu", uid="u", group=GroupRequest(name="g"),
                         job={**fields, **changes.pop("job", {})}, **changes)


def test_the_driver_resolves_in_the_request_s_namespace_and_tells_the_ranks(roots):
    from videojob_runtime.driver import job_request

    job, output_dir, _ = job_request(_driver_request(output_uri="local://b/videos"))
    assert output_dir == roots["outputs"].resolve() / "a/b/videos" and job.namespace == "a"
    assert Path(job.checkpoint_dir).is_relative_to(output_dir)
    # the default location is where it was before locations were per namespace: <root>/<namespace>/<name>
    assert job_request(_driver_request())[1] == roots["outputs"].resolve() / "a/tiny-cpu"
    with pytest.raises(ValueError, match="job.namespace is the driver's to set"):
        job_request(_driver_request(job={"namespace": "b"}))
    _b_untouched(roots)


def test_a_rank_resolves_inputs_in_the_request_s_namespace(roots):
    """The rank side (the checkpoint fingerprint reads the inputs, as the pipeline's conditioning does)."""
    from videojob_runtime.request import JobRequest
    from videojob_runtime.resume import job_fingerprint

    request = dict(job_id="j", model_id="tiny-cogvideox", task="i2v", prompt="p", width=8, height=8, frames=1,
                   fps=8, steps=1, guidance=1.0, image="local://b/poster.png")
    job_fingerprint(JobRequest(**request))  # videojob run: b/poster.png under the root is this user's
    with pytest.raises(FileNotFoundError) as caught:  # a's request: a's own b/poster.png, which is not there
        job_fingerprint(JobRequest.from_dict({**request, "namespace": "a"}))
    assert caught.value.filename == str(roots["inputs"].resolve() / "a/b/poster.png")
    _link(roots["inputs"] / "a/peek", roots["inputs"] / "b")
    with pytest.raises(JobFailure, match=r"^spec.image: .* outside namespace a's directory"):
        job_fingerprint(JobRequest.from_dict({**request, "image": "local://peek/poster.png", "namespace": "a"}))


def test_a_rank_worker_reads_the_image_in_the_request_s_namespace(roots):
    """The worker's own path (no Ray): a's local://b/poster.png is a's, which is not there; b's is never read."""
    require_module("torch")
    from videojob_runtime.request import JobRequest
    from videojob_runtime.worker import RankWorker

    out = RankWorker(0, 1).run(JobRequest(
        job_id="peek", model_id="tiny-cogvideox-i2v", task="i2v", prompt="a cat", width=64, height=64, frames=9,
        fps=8, steps=1, guidance=6.0, image="local://b/poster.png", frames_dtype="float32", namespace="a"))
    assert not out["ok"] and out["error"]["stage"] == "inputs", out
    assert out["error"]["field"] == "spec.image", out
    assert str(roots["inputs"].resolve() / "a/b/poster.png") in out["error"]["message"], out
