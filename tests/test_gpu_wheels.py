"""The wheels a GPU session carries (bench/wheelset.py) resolve, offline, against the device image's recorded
package list (bench/gpu_image_packages.txt): the committed manifest (bench/gpu_wheels.json) always; the files in
.whl/ and pip's own resolver when they are there (CI has no .whl/: that part is skipped)."""

import os
import sys

import pytest
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import wheelset  # noqa: E402

ROOTS = [*wheelset.ROOTS, *wheelset.project_requirements()]
HAS_WHEELS = wheelset.WHEEL_DIR.is_dir() and any(wheelset.WHEEL_DIR.glob("*.whl"))


def test_image_list_is_the_recorded_one():
    image = wheelset.read_image()
    assert len(image) >= 190
    assert image["torch"] == Version("2.11.0+cu130") and image["triton"] == Version("3.6.0")
    for lacking in ("deepspeed", "hjson", "pydantic", "torchjd"):  # what the issue says the image lacks
        assert lacking not in image


def test_manifest_resolves_against_the_image():
    wheels = wheelset.load_manifest()
    res = wheelset.resolve(wheels, wheelset.read_image(), ROOTS)
    assert res.ok, "\n".join(res.problems)
    versions = {w.name: w.version for w in wheels}
    assert versions["deepspeed"] == wheelset.DEEPSPEED_VERSION
    for name in ("hjson", "pydantic", "pydantic-core", "annotated-types", "torchjd", "quadprog", "cvxpy"):
        assert name in versions, name
    assert sum(w.bytes for w in wheels) < wheelset.MAX_BYTES


def test_deepspeed_pin_is_the_environments():
    from importlib import metadata

    try:
        here = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        pytest.skip("deepspeed is not installed here")
    assert here == wheelset.DEEPSPEED_VERSION


def test_the_resolver_finds_what_would_break_the_install():
    wheels = wheelset.load_manifest()
    image = wheelset.read_image()
    without = [w for w in wheels if w.name != "pydantic"]
    assert any(
        "pydantic" in p and "neither carried" in p for p in wheelset.resolve(without, image, ROOTS).problems
    )
    twice = [*wheels, next(w for w in wheels if w.name == "hjson")]
    assert any("carried twice" in p for p in wheelset.resolve(twice, image, ROOTS).problems)
    old_torch = dict(image, torch=Version("2.0.0"))
    assert any(
        "torch" in p and "image has 2.0.0" in p for p in wheelset.resolve(wheels, old_torch, ROOTS).problems
    )
    windows = wheelset.Wheel("hjson-3.1.0-cp311-cp311-win_amd64.whl", "hjson", "3.1.0")
    bad_tag = [w for w in wheels if w.name != "hjson"] + [windows]
    assert any("no tag" in p for p in wheelset.resolve(bad_tag, image, ROOTS).problems)
    extra = [*wheels, wheelset.Wheel("six-1.16.0-py2.py3-none-any.whl", "six", "1.16.0")]
    assert any("in the image already" in p for p in wheelset.resolve(extra, image, ROOTS).problems)
    assert any("over" in p for p in wheelset.resolve(wheels, image, ROOTS, max_bytes=1).problems)


@pytest.mark.skipif(
    not HAS_WHEELS, reason="no .whl/ (python3 bench/gpu_session.py --download-wheels fills it)"
)
def test_the_wheel_files_are_the_manifest_and_pip_installs_them_offline():
    files = wheelset.wheels_in()
    assert {(w.name, w.version) for w in files} == {(w.name, w.version) for w in wheelset.load_manifest()}
    res = wheelset.resolve(files, wheelset.read_image(), ROOTS)
    assert res.ok, "\n".join(res.problems)
    rc, out, report = wheelset.pip_dry_run()
    assert rc == 0, out[-3000:]
    chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
    assert chosen["deepspeed"] == wheelset.DEEPSPEED_VERSION
