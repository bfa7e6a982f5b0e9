"""The training text of the asset language model: the Python standard library's own source files.

Every Python installation has them, so the model retrains anywhere without a download. The file list
is a sorted glob in the stdlib directory; every `holdout_every`-th file is held out. Besides the
files themselves, chat examples are cut out of them with `ast`: the user asks for a function by
its signature and docstring summary, the assistant answers with the function's source. They teach
the model the chat format and to end its turn, so chat demos and end-of-turn stops see real text.

The corpus differs between Python versions; `corpus_digest` (stored with the model) says which one
a model was trained on.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from pathlib import Path

Messages = list[dict[str, str]]


def stdlib_dir() -> Path:
    """The directory of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(pattern: str) -> list[Path]:
    """Files matching glob `pattern` in the stdlib directory, sorted by relative path."""
    root = stdlib_dir()
    files = sorted((p for p in root.glob(pattern) if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ValueError(f"corpus_glob: {pattern!r} matches no file in {root}")
    return files


def read_texts(files: list[Path]) -> list[str]:
    """The files' UTF-8 text (the stdlib's source encoding)."""
    return [f.read_text(encoding="utf-8") for f in files]


def corpus_digest(files: list[Path], texts: list[str]) -> str:
    """sha256 over the files' relative names and contents: equal digests mean equal training text."""
    root = stdlib_dir()
    h = hashlib.sha256()
    for f, text in zip(files, texts):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def split(items: list, holdout_every: int) -> tuple[list, list]:
    """(train, held_out): every `holdout_every`-th item (0, k, 2k, ...) is held out."""
    if holdout_every < 2:
        raise ValueError(f"holdout_every: must be >= 2, got {holdout_every}")
    held = [x for i, x in enumerate(items) if i % holdout_every == 0]
    train = [x for i, x in enumerate(items) if i % holdout_every != 0]
    return train, held


def chat_examples(text: str, max_chars: int) -> list[Messages]:
    """A user/assistant exchange per documented function in `text` whose source fits `max_chars`."""
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a stdlib file for another Python version: no examples from it
        return []
    lines = text.splitlines(keepends=True)
    examples = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip() if doc else ""
        if not summary or node.name.startswith("_"):
            continue
        # Whole lines, dedented: a method's first line alone would lose its indentation.
        source = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).rstrip()
        if len(source) > max_chars:
            continue
        ask = f"Write a Python function `{node.name}({ast.unparse(node.args)})`. {' '.join(summary.split())}"
        examples.append([{"role": "user", "content": ask}, {"role": "assistant", "content": source}])
    return examples
