"""Which files make a case: the Medical Segmentation Decathlon's layout or nnU-Net v2's.

- Decathlon: ``dataset.json`` with a ``training`` list of ``{"image": "./imagesTr/x.nii.gz",
  "label": "./labelsTr/x.nii.gz"}``, ``labels`` as index -> name (``{"0": "background",
  "1": "spleen"}``) and ``modality`` as channel -> name (``{"0": "CT"}``); a multi-channel case
  is one 4-D file.
- nnU-Net v2: ``dataset.json`` with ``channel_names`` (channel -> name), ``labels`` as name ->
  index (``{"background": 0, "liver": 1}``), ``file_ending`` and no lists: the cases are
  ``imagesTr/<case>_<channel:04d><file_ending>`` beside ``labelsTr/<case><file_ending>``.
  (Region labels, a list of indices per name, are not read yet: refused.)

Every failure names the file and the fix (accel_train.errors.UserError)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from accel_train.errors import UserError

NIFTI = (".nii.gz", ".nii")


@dataclass
class Case:
    name: str
    images: list[Path]  # one file per channel (nnU-Net), or one (possibly 4-D) file
    label: Path


@dataclass
class Layout:
    kind: str  # "decathlon" or "nnunet"
    cases: list[Case]  # sorted by name
    classes: list[str]  # index -> name; 0 is the background
    channels: list[str]  # channel -> modality name ("CT", "T2", ...)

    @property
    def is_ct(self) -> bool:
        return bool(self.channels) and all(c.strip().upper() == "CT" for c in self.channels)


def read_layout(root: Path) -> Layout:
    """The training cases of a Decathlon or nnU-Net v2 folder (its dataset.json says which)."""
    meta_file = root / "dataset.json"
    if not meta_file.is_file():
        raise UserError(
            f"dataset.root={root}: no dataset.json in it. dataset=volume_folder reads a Medical "
            "Segmentation Decathlon folder (dataset.json, imagesTr/, labelsTr/) or an nnU-Net v2 "
            "raw folder (dataset.json with channel_names, imagesTr/<case>_0000.nii.gz, "
            "labelsTr/); point dataset.root at one (docs/medical.md)."
        )
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(
            f"{meta_file}: not readable JSON ({err}). Fix or replace the file."
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("labels"), dict):
        raise UserError(
            f"{meta_file}: it has no `labels` mapping (Decathlon: index -> name, nnU-Net: name "
            "-> index), so the classes are unknown. Add one, e.g. "
            '`"labels": {"0": "background", "1": "spleen"}`.'
        )
    if "channel_names" in meta:
        return _nnunet(root, meta, meta_file)
    return _decathlon(root, meta, meta_file)


def _classes(pairs: list[tuple[int, str]], meta_file: Path) -> list[str]:
    indices = sorted(i for i, _ in pairs)
    if indices != list(range(len(indices))) or len(indices) < 2:
        raise UserError(
            f"{meta_file}: its labels are numbered {indices}; they must be 0 (background), 1, "
            "... without gaps, at least two of them. Fix the `labels` entry."
        )
    return [name for _, name in sorted(pairs)]


def _channels(mapping: object, key: str, meta_file: Path) -> list[str]:
    if not isinstance(mapping, dict) or not mapping:
        raise UserError(
            f"{meta_file}: `{key}` must map each channel index to its modality, e.g. "
            '`{"0": "CT"}`.'
        )
    try:
        return [str(v) for _, v in sorted((int(k), v) for k, v in mapping.items())]
    except ValueError:
        raise UserError(
            f"{meta_file}: the keys of `{key}` must be channel indices (0, 1, ...)."
        ) from None


def _decathlon(root: Path, meta: dict, meta_file: Path) -> Layout:
    try:
        pairs = [(int(k), str(v)) for k, v in meta["labels"].items()]
    except ValueError:
        raise UserError(
            f'{meta_file}: Decathlon `labels` map an index to a name (`"1": "spleen"`), '
            "and a key is not an integer. nnU-Net v2's name -> index form needs its "
            "`channel_names` key as well."
        ) from None
    classes = _classes(pairs, meta_file)
    channels = _channels(meta.get("modality"), "modality", meta_file)
    training = meta.get("training")
    if not isinstance(training, list) or not training:
        raise UserError(
            f'{meta_file}: no `training` list of {{"image": ..., "label": ...}} entries, as '
            "a Decathlon dataset.json has. Add it (or write an nnU-Net v2 dataset.json)."
        )
    cases = []
    for entry in training:
        if not (isinstance(entry, dict) and "image" in entry):
            raise UserError(
                f"{meta_file}: a `training` entry is {entry!r}; it needs `image` and `label`."
            )
        image = (root / str(entry["image"])).resolve()
        if not entry.get("label"):
            raise UserError(
                f"{image}: the image has no label in {meta_file} (its `training` entry has no "
                "`label`). Add the label file, or remove the case from the list."
            )
        label = (root / str(entry["label"])).resolve()
        cases.append(Case(_stem(image), [image], label))
    _check_exist(cases)
    return Layout("decathlon", sorted(cases, key=lambda c: c.name), classes, channels)


def _nnunet(root: Path, meta: dict, meta_file: Path) -> Layout:
    pairs = []
    for name, value in meta["labels"].items():
        if not isinstance(value, int):
            raise UserError(
                f"{meta_file}: label {name!r} is {value!r}: region-based labels (a list of "
                "indices) are not read yet by dataset=volume_folder; give each class one index."
            )
        pairs.append((value, str(name)))
    classes = _classes(pairs, meta_file)
    channels = _channels(meta.get("channel_names"), "channel_names", meta_file)
    ending = str(meta.get("file_ending") or ".nii.gz")
    images_dir, labels_dir = root / "imagesTr", root / "labelsTr"
    pattern = re.compile(rf"^(.+)_(\d{{4}}){re.escape(ending)}$")
    found: dict[str, dict[int, Path]] = {}
    for path in sorted(images_dir.glob(f"*{ending}")) if images_dir.is_dir() else []:
        m = pattern.match(path.name)
        if m is None:
            raise UserError(
                f"{path}: an nnU-Net image file is named <case>_<channel:04d>{ending}; this one "
                "is not. Rename it."
            )
        found.setdefault(m.group(1), {})[int(m.group(2))] = path.resolve()
    if not found:
        raise UserError(
            f"{images_dir}: no <case>_0000{ending} files. Point dataset.root at an nnU-Net v2 "
            "raw folder (dataset.json, imagesTr/, labelsTr/)."
        )
    cases = []
    for name, files in sorted(found.items()):
        missing = [f"{name}_{c:04d}{ending}" for c in range(len(channels)) if c not in files]
        if missing:
            raise UserError(
                f"{images_dir}: case {name} lacks the channel file(s) {', '.join(missing)} "
                f"(dataset.json names {len(channels)} channels). Add them or remove the case."
            )
        cases.append(Case(name, [files[c] for c in range(len(channels))],
                          (labels_dir / f"{name}{ending}").resolve()))  # fmt: skip
    _check_exist(cases)
    orphans = sorted(set(_nnunet_labels(labels_dir, ending)) - set(found))
    if orphans:
        raise UserError(
            f"{labels_dir}: label(s) {', '.join(orphans[:5])} have no image in imagesTr/ (no "
            f"{orphans[0]}_0000{ending}). Add the images, or move the labels away."
        )
    return Layout("nnunet", cases, classes, channels)


def _nnunet_labels(labels_dir: Path, ending: str) -> list[str]:
    if not labels_dir.is_dir():
        return []
    return [p.name[: -len(ending)] for p in labels_dir.glob(f"*{ending}")]


def _check_exist(cases: list[Case]) -> None:
    for case in cases:
        for image in case.images:
            if not image.is_file():
                raise UserError(
                    f"{image}: listed as the image of case {case.name}, but there is no such "
                    "file. Restore it, or remove the case from dataset.json."
                )
        if not case.label.is_file():
            raise UserError(
                f"{case.images[0]}: this image has no label ({case.label} does not exist). Add "
                "the label map, or remove the case."
            )


def _stem(path: Path) -> str:
    name = path.name
    for ending in NIFTI:
        if name.endswith(ending):
            return name[: -len(ending)]
    return path.stem
