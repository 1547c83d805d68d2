"""The training prompt mix (benchmarks/gpu/prompt_mix.py): prompt sets read from wheels, the HumanEval filter, and
training on several regenerated sets at once. Wheels are made here with zipfile; nothing is downloaded."""

from __future__ import annotations

import ast
import gzip
import json
import platform
import re
import zipfile

import pytest

from benchmarks.gpu.prompt_mix import (
    CHAMP_FILE,
    CODEIO_FILES,
    SCICODE_FILES,
    STDLIB,
    HumanEvalFilter,
    build_mix,
    champ_prompts,
    codeio_prompts,
    docstring_prompts,
    fresh_prompts,
    function_prompts,
    heldout_prompts,
    scicode_prompts,
    sharegpt_prompts,
)
from hf_dflash.cli import main as cli_main
from hf_dflash.training import RegeneratedData
from hf_dflash.training.data import write_jsonl_prompts

# A made-up task in HumanEval's layout (not one of HumanEval's).
TASK = {
    "entry_point": "count_rising_pairs",
    "prompt": 'def count_rising_pairs(values: list) -> int:\n    """ Given a list of integers, return how many '
              "neighbouring pairs go up, that is the second number of the pair is larger than the first one.\n"
              "    >>> count_rising_pairs([1, 3, 2, 5])\n    2\n    \"\"\"\n",
    "canonical_solution": "    return sum(1 for a, b in zip(values, values[1:]) if b > a)\n",
}
DOCSTRING = ("Given a list of integers, return how many neighbouring pairs go up, that is the second number of the "
             "pair is larger than the first one.")


@pytest.fixture
def humaneval():
    helper = {"entry_point": "f", "prompt": "def f(n):\n    \"\"\"Return n doubled.\"\"\"\n",
              "canonical_solution": "    return 2 * n\n"}
    return HumanEvalFilter([TASK, helper])


def test_humaneval_like_prompts_are_dropped_and_unrelated_ones_kept(humaneval):
    # the docstring's words in another wrapping (case and punctuation differ): 13 words in a row are shared
    assert humaneval.reason(f"Write a Python function for this: {DOCSTRING.upper().replace(',', ';')}") == "n-gram"
    assert humaneval.reason("Why does count_rising_pairs([1, 2]) return 1?") == "function name"
    assert humaneval.reason("Translate to C++:\ndef f(x):\n    return x + 1") == "function name"
    # 12 shared words in a row are not enough; a one-word name used outside a definition is common math text
    assert humaneval.reason(" ".join(DOCSTRING.split()[:12]) + " please") is None
    assert humaneval.reason("Given f(x) = x^2 + 1, what is f(3)?") is None
    assert humaneval.reason("Write a function that returns the neighbouring pairs of a list that go down.") is None
    only_one_word_names = HumanEvalFilter([{"entry_point": "f", "prompt": "def f(n):\n", "canonical_solution": ""}])
    assert only_one_word_names.reason("Call g(x) (twice).") is None
    assert only_one_word_names.reason("def f(x): pass") == "function name"


def test_build_mix_counts_what_it_drops_per_source_and_reason(humaneval):
    pairs = [("keep me", "set a"), (DOCSTRING, "set a"), ("keep me", "set b"), ("def f(n): pass", "set b"),
             ("and me", "set b")]
    kept, dropped = build_mix(pairs, humaneval)
    assert kept == [("keep me", "set a"), ("and me", "set b")]
    assert dropped == {("set a", "n-gram"): 1, ("set b", "repeated"): 1, ("set b", "function name"): 1}


def _wheel(path, files: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
    return path


def test_wheel_sets_become_chat_prompts_tagged_with_their_source(tmp_path):
    def codeio(description):
        return {"task_description": description, "input_output_spec": f"Input: `n` (int) for {description}",
                "code_sample": "import math\n\n# main function\ndef main_solution(n, k=2):\n    return n"}

    lines = "".join(json.dumps(codeio(d)) + "\n" for d in ("Count the ways.", "Sum the digits."))
    array = json.dumps([codeio("Sum the digits."), codeio("Find the root.")], indent=4)  # one task repeated
    wheels = {"reasoning-gym": _wheel(tmp_path / "rg.whl", {CODEIO_FILES[0][2]: gzip.compress(lines.encode()),
                                                            CODEIO_FILES[1][2]: gzip.compress(array.encode())})}
    prompts = codeio_prompts(wheels)
    assert [source for _, source in prompts] == ["reasoning-gym 0.1.25 codeio.jsonl.gz"] * 2 + [
        "reasoning-gym 0.1.25 codeio-hq.jsonl.gz"]
    assert prompts[0][0] == ("Write a Python function `main_solution(n, k=2)` for this task.\n\nCount the ways.\n\n"
                             "Input: `n` (int) for Count the ways.")

    step = {"step_description_prompt": "Wrap coordinates. ", "function_header": "def wrap(r, L):\n    '''Wrap.'''",
            "return_line": "    return r"}
    problem = {"required_dependencies": "import numpy as np\n", "sub_steps": [step, {**step, "return_line": None}]}
    wheels["nvidia-scicode"] = _wheel(tmp_path / "sc.whl", {SCICODE_FILES[0][2]: json.dumps(problem) + "\n",
                                                            SCICODE_FILES[1][2]: ""})
    prompts = scicode_prompts(wheels)
    assert [source for _, source in prompts] == ["nvidia-scicode 26.3 problems_all.jsonl"] * 2
    assert prompts[0][0] == ("Wrap coordinates.\n\nComplete this Python code; you can use these imports:\n"
                             "```python\nimport numpy as np\n```\n\n```python\ndef wrap(r, L):\n    '''Wrap.'''\n"
                             "    return r\n```")
    assert prompts[1][0].endswith("'''Wrap.'''\n```")  # a step without a return line

    problems = {"problems": {"P_1": {"_text": "How many strings?", "_raw_text": "How @@many@@"}}}
    wheels["champ-dataset"] = _wheel(tmp_path / "ch.whl", {CHAMP_FILE[2]: json.dumps(problems)})
    assert champ_prompts(wheels) == [("How many strings?", "champ-dataset 1.0.0 v0.json")]


MODULE = '''"""A made-up module: what the docstring set keeps and leaves out."""
from typing import List, Optional
import collections.abc as cabc
from .local import Thing


def rolling_means(values: List[float], width: int = 3) -> Optional[List[float]]:
    """Return the mean of every window of `width` neighbouring values.
    >>> rolling_means([1.0, 2.0, 3.0, 4.0], 2)
    [1.5, 2.5, 3.5]
    """
    if width > len(values):
        return None
    return [sum(values[i : i + width]) / width for i in range(len(values) - width + 1)]


def _private_helper(values):
    """Private functions are left out, however well documented they are."""
    total = 0
    for value in values:
        total += value
    return total


def short_doc(values):
    """Too short."""
    total = 0
    for value in values:
        total += value
    return total


def short_body(values: Thing):
    """A body of fewer than three lines after the docstring is left out."""
    return sorted(values)


def count_rising_pairs(values: list) -> int:
    """Count the neighbouring pairs of a list whose second number is the larger one."""
    count = 0
    for a, b in zip(values, values[1:]):
        count += b > a
    return count


class Inventory(cabc.Mapping, metaclass=type):
    """A class: its public methods are kept, each under the class line."""

    @staticmethod
    def restock(items: cabc.Iterable, amount=1):
        """Add `amount` to the count of every item, and return the new counts."""
        counts = {}
        for item in items:
            counts[item] = counts.get(item, 0) + amount
        return counts
'''


def test_docstring_prompts_are_signatures_and_docstrings_written_as_humaneval_writes_them(tmp_path):
    """The source's own signature and docstring lines, the imports the signature needs above them, no body; test
    directories, private names, short docstrings and short bodies left out; each prompt tagged with its source."""
    stdlib = tmp_path / "Lib"
    (stdlib / "tests").mkdir(parents=True)
    (stdlib / "made_up.py").write_text(MODULE)
    (stdlib / "tests" / "test_made_up.py").write_text(MODULE)  # test code: not read
    wheels = {"made-up": _wheel(tmp_path / "mu.whl", {"made_up/core.py": MODULE.replace("\n", "\r\n"),
                                                      "made_up/tests/test_core.py": MODULE})}
    pairs = docstring_prompts(wheels, stdlib, packages=[("made-up", "0.1")])
    python = f"cpython {platform.python_version()} Lib/*.py"
    assert [source for _, source in pairs] == [python] * 3 + ["made-up 0.1 *.py"] * 3
    assert [p for p, _ in pairs[:3]] == [p for p, _ in pairs[3:]]  # Windows line ends read the same
    rolling, rising, restock = (p for p, _ in pairs[:3])
    assert rolling == ("from typing import List, Optional\n\n\n"
                       "def rolling_means(values: List[float], width: int = 3) -> Optional[List[float]]:\n"
                       '    """Return the mean of every window of `width` neighbouring values.\n'
                       "    >>> rolling_means([1.0, 2.0, 3.0, 4.0], 2)\n    [1.5, 2.5, 3.5]\n    \"\"\"\n")
    assert rising.startswith("\ndef count_rising_pairs(values: list) -> int:\n")  # no import needed: as HumanEval
    assert restock == ("import collections.abc as cabc\n\n\nclass Inventory(cabc.Mapping, metaclass=type):\n"
                       "    @staticmethod\n    def restock(items: cabc.Iterable, amount=1):\n"
                       '        """Add `amount` to the count of every item, and return the new counts."""\n')
    # HumanEval's filter applies to this set as to every other: a prompt defining a HumanEval function is dropped.
    kept, dropped = build_mix(pairs, HumanEvalFilter([TASK]))
    assert [p for p, _ in kept] == [rolling, restock]
    assert dropped == {(python, "function name"): 1, ("made-up 0.1 *.py", "repeated"): 3}  # the same 3 again


@pytest.mark.parametrize("module", ["textwrap.py", "json/decoder.py", "statistics.py"])
def test_docstring_prompts_of_stdlib_modules_parse_and_carry_a_docstring(module):
    """Each prompt plus a body line is Python whose last function has its docstring and nothing else yet."""
    prompts = function_prompts((STDLIB / module).read_text(encoding="utf-8"))
    assert prompts
    for prompt in prompts:
        body = re.search(r"^( *)def ", prompt, re.MULTILINE)[1] + "    pass"  # a method's body is indented deeper
        tree = ast.parse(prompt + body)
        function = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)][-1]
        assert ast.get_docstring(function) and len(function.body) == 2
        assert 40 <= len(ast.get_docstring(function)) <= 1200


def test_training_takes_several_regenerated_sets_and_records_every_source(tmp_path, monkeypatch):
    """An earlier set's regenerated file is reused as it is, a new set is answered alone, and training runs on
    both: its record counts the sequences of both and the prompts per source of both."""
    monkeypatch.chdir(tmp_path)
    old = [f"Once upon a time, a cat saw a {thing}." for thing in ("dog", "tree", "ball", "bird")]
    new = [f"The girl went to the {place}." for place in ("park", "shop", "sea")]
    write_jsonl_prompts(old, "old.jsonl", sources=["old set"] * len(old))
    write_jsonl_prompts(new, "new.jsonl.gz", sources=["new set"] * len(new))
    common = ["train", "--target", "stories260k", "--max-new-tokens", "10", "--mask-token-id", "0",
              "--block-size", "4", "--batch-size", "2", "--max-anchors", "4"]
    assert cli_main([*common, "--prompts", "old.jsonl", "--regenerated", "old.safetensors", "--out", "a",
                     "--regenerate-only"]) == 0
    before = (tmp_path / "old.safetensors").read_bytes()
    assert cli_main([*common, "--prompts", "old.jsonl", "new.jsonl.gz", "--regenerated", "old.safetensors",
                     "new.safetensors", "--out", "b", "--steps", "2"]) == 0
    assert (tmp_path / "old.safetensors").read_bytes() == before  # reused, not answered again
    sets = [RegeneratedData.load(tmp_path / name) for name in ("old.safetensors", "new.safetensors")]
    assert [len(s) for s in sets] == [len(old), len(new)]
    record = json.loads((tmp_path / "b" / "training_args.json").read_text())
    assert record["data"]["sequences"] == len(old) + len(new)
    assert record["data"]["response_tokens"] == sum(s.num_response_tokens for s in sets)
    assert record["data"]["prompt_sources"] == {"old set": len(old), "new set": len(new)}
    assert record["prompts"] == "old.jsonl new.jsonl.gz"


def test_one_regenerated_file_per_prompt_set(capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["train", "--target", "stories260k", "--out", "o", "--prompts", "sharegpt:2", "sharegpt-turns:2",
                  "--regenerated", "one.safetensors"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--prompts gives 2 sets and --regenerated 1 files; pass one regenerated file per prompt set" in err
    assert len(err.splitlines()) == 1


def test_heldout_turns_are_outside_the_mix_and_the_same_each_time():
    """Benchmark prompts must be turns the drafter never trained on: none of the mix's ShareGPT turns, reproducibly."""
    trained = {p for p, _ in sharegpt_prompts(30000, 1500)}
    heldout = heldout_prompts(8, 30000, 1500)
    assert len(set(heldout)) == 8 and not trained & set(heldout)
    assert all(40 <= len(p) <= 1500 and p.isascii() for p in heldout)
    assert heldout == heldout_prompts(8, 30000, 1500)


def test_fresh_turns_are_outside_the_mix_and_the_heldout_turns():
    """Drafter 7's chat turns: none of the mix's turns nor of the 32 held-out ones, with the held-out filters."""
    trained = {p for p, _ in sharegpt_prompts(30000, 1500)}
    fresh = [p for p, _ in fresh_prompts(50, 30000, 1500)]
    assert len(set(fresh)) == 50 and not (trained | set(heldout_prompts(32, 30000, 1500))) & set(fresh)
    assert all(40 <= len(p) <= 1500 and p.isascii() for p in fresh)
