"""Field documentation of the config dataclasses: the string literal right after each field.

    block_size: int = 16
    \"\"\"Tokens per KV block, a power of two (paper default 16).\"\"\"

Python keeps no such attribute docstring at run time, so `attribute_docs` reads the class's source
with `ast`, as vLLM's `get_attr_docs` does; `jpaged serve --help` takes its flags' help from them.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring (`inspect.cleandoc`) for every annotated field of `cls`
    that has one; OSError when the class's source cannot be read."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for field, after in zip(body, body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs
