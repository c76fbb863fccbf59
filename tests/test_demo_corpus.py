"""The demo model's corpus: whole-file held-out split, chat examples drawn from documented functions."""
from __future__ import annotations

import ast

from launch.demo_corpus import SourceFile, chat_pairs, is_held_out, split, stdlib_files

SOURCE = '''
def fibonacci(n: int, *, memo=None) -> int:
    """Return the n-th Fibonacci number.

    Longer text that the question leaves out.
    """
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)


class Box:
    def open(self, force=False):
        """Open the box."""
        if force:
            return True
        return False

    def _hidden(self):
        """Private: never a chat example."""


def undocumented():
    return 1
'''


def test_chat_pairs_ask_for_a_documented_public_function_and_answer_with_its_source():
    pairs = dict(chat_pairs(SourceFile("box.py", SOURCE)))
    assert set(pairs) == {"Write a Python function `fibonacci(n: int, *, memo=None)`: Return the n-th Fibonacci number.",
                          "Write a Python function `open(self, force=False)`: Open the box."}
    for answer in pairs.values():
        assert not answer.startswith(" ") and isinstance(ast.parse(answer).body[0], ast.FunctionDef)
    assert pairs["Write a Python function `open(self, force=False)`: Open the box."].splitlines()[-1] == \
        "    return False"  # dedented as a whole: the body keeps its own indentation
    assert list(chat_pairs(SourceFile("bad.py", "def broken(:\n"))) == []


def test_the_held_out_split_is_whole_files_chosen_by_path_and_seed():
    files = [SourceFile(f"pkg/module_{i}.py", f"x = {i}\n") for i in range(2000)]
    train, held = split(files, 0.05, seed=0)
    assert {f.path for f in train}.isdisjoint(f.path for f in held) and len(train) + len(held) == len(files)
    assert 50 <= len(held) <= 150
    assert split(list(reversed(files)), 0.05, seed=0)[1] == list(reversed(held))  # the order does not matter
    assert {f.path for f in split(files, 0.05, seed=1)[1]} != {f.path for f in held}
    assert all(is_held_out(f, 0.05, 0) for f in held)


def test_the_stdlib_corpus_has_no_tests_and_a_fixed_order():
    files = stdlib_files()
    assert len(files) > 500 and "os.py" in {f.path for f in files}
    paths = [f.path for f in files]
    assert not any(part in ("test", "tests", "site-packages") for path in paths for part in path.split("/")[:-1])
    assert paths == [f.path for f in stdlib_files()]
