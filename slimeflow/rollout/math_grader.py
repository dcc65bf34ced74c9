"""Math answer checking with the rules slime's rm_hub applies, so a reward here is the reward a slime user gets.

Three pieces, each the behaviour of the public grader slime uses (THUDM/slime 624b824a8, rm_hub/math_utils.py and
math_dapo_utils.py), written afresh:
- `boxed_answer`: the content of the last `\\boxed{...}` (only the last `\\boxed`, braces matched; `\\fbox` and
  `\\boxed 5` give None, as in slime).
- `grade`: Hendrycks' MATH string normalisation compared for equality, else the PRM800K grader: a looser
  normalisation, tuples element by element, unreduced fractions and integers compared as text, the rest by
  `sympy.simplify(truth - given) == 0` (only for expressions of at most two unknowns without large powers).
- `minerva_normalize`: the DAPO / Minerva normalisation of a final answer (units, \\text, $...$ and shorthand TeX).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import sympy
from pylatexenc import latex2text
from sympy.parsing import sympy_parser

# --- boxed answers ---------------------------------------------------------------------------------------------


def last_boxed(text: str, markers: tuple[str, ...] = ("\\boxed", "\\fbox")) -> str | None:
    """The last `\\boxed...{...}` span of `text` through the brace that balances its first `{`, or None (unbalanced).

    `markers` are tried in turn; the first found decides (slime's math grader falls back to `\\fbox` only when there
    is no `\\boxed`; its DAPO scorer looks for `\\boxed{` alone)."""
    start = next((at for at in (text.rfind(marker) for marker in markers) if at >= 0), -1)
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def unboxed(span: str | None) -> str | None:
    """The content of a `\\boxed{...}` span, or None when `span` is not one (None, `\\fbox{...}`, `\\boxed 5`)."""
    if not isinstance(span, str) or not span.startswith("\\boxed{") or not span.endswith("}"):
        return None
    return span[len("\\boxed{"):-1]


def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, or None (no `\\boxed`, unbalanced, or not `\\boxed{`)."""
    return unboxed(last_boxed(text))


# --- Hendrycks' MATH normalisation (string equality after it) ----------------------------------------------------


class _Unchanged(Exception):
    """Normalisation met something it cannot rewrite: the answer is compared as it was given."""


def _expand_sqrt(text: str) -> str:
    r"""`\sqrt3` -> `\sqrt{3}` (one character taken as the argument)."""
    head, *rest = text.split("\\sqrt")
    out = [head]
    for part in rest:
        if not part:
            raise _Unchanged
        out.append("\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:])
    return "".join(out)


def _expand_fracs(text: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{2}` -> `\frac{1}{2}`; a `\frac` with one character after it stays."""
    head, *rest = text.split("\\frac")
    out = [head]
    for part in rest:
        out.append("\\frac")
        if not part:
            raise _Unchanged
        if part[0] == "{":
            out.append(part)
            continue
        if len(part) < 2:
            return text
        first, second, tail = part[0], part[1], part[2:]
        out.append("{" + first + "}" + ("{" + second + "}" if second != "{" else second) + tail)
    return "".join(out)


def _slash_to_frac(text: str) -> str:
    """`3/4` (two plain integers) -> `\\frac{3}{4}`."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{num}}}{{{den}}}" if text == f"{num}/{den}" else text


def hendrycks_strip(text: str) -> str:
    """Hendrycks' MATH string rewrites (slime's `_strip_string`); raises _Unchanged on what it cannot rewrite."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        text = text.replace(old, new)
    if "\\text{ " in text:  # units on the right: `5 \text{ cm}`
        pieces = text.split("\\text{ ")
        if len(pieces) != 2:
            raise _Unchanged
        text = pieces[0]
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `x = 5` -> `5`
        text = sides[1]
    if "\\sqrt" in text:
        text = _expand_sqrt(text)
    text = _expand_fracs(text.replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_frac(text)


_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def hendrycks_normalize(answer: str | None) -> str | None:
    """Hendrycks' MATH normalisation of an answer; one it cannot rewrite stays as given (an outer \\text{} removed)."""
    if answer is None:
        return None
    answer = answer.strip()
    wrapped = _TEXT_WRAPPED.search(answer)
    if wrapped:
        answer = wrapped.group("text").strip()
    try:
        return hendrycks_strip(answer)
    except _Unchanged:
        return answer


def hendrycks_equal(given: str | None, truth: str | None) -> bool:
    """Whether `given` and `truth` are the same text after Hendrycks' normalisation."""
    return hendrycks_normalize(truth) == hendrycks_normalize(given)


# --- the PRM800K grader ------------------------------------------------------------------------------------------

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard")
_UNIT_PATTERNS = tuple(re.compile(rf"{unit}(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_BRACKETS = "()[]"


def _drop_thousands_commas(text: str) -> str:
    """`1,000,000` -> `1000000`, leaving the commas of tuples (`1,2`) alone."""
    while True:
        changed = _THOUSANDS_COMMA.sub(r"\1\3\4", text)
        if changed == text:
            return text
        text = changed


def _text_is_int(text: str) -> bool:
    try:
        value = float(_drop_thousands_commas(text))
        return abs(value - int(round(value))) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _float_is_int(text: str) -> bool:
    try:
        value = float(text)
        return abs(value - int(round(value))) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _latex_to_text(expr: str) -> str:
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, name in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(symbol, name)
    return expr.strip()


def prm800k_normalize(expr: str | None) -> str | None:
    """The PRM800K grader's normalisation: units, $, %, words and LaTeX to plain text, lower case, integers bare."""
    if expr is None:
        return None
    wrapped = _TEXT_WRAPPED.search(expr)
    if wrapped:
        expr = wrapped.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for pattern in _UNIT_PATTERNS:
        expr = pattern.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _float_is_int(expr):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # pylatexenc gives up on malformed LaTeX: the grader goes on with the text as it is
            pass
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number `7 3/4` -> `7+3/4`
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _text_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _elements(expr: str) -> list[str]:
    """The elements of a tuple or interval `(a,b)` / `[a,b)`; anything else is one element."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in _BRACKETS and expr[-1] in _BRACKETS and \
            not any(ch in _BRACKETS for ch in expr[1:-1]):
        return [part.strip() for part in expr[1:-1].split(",")]
    return [expr]


_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_RISKY_POWERS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))


def _sympy_may_evaluate(expr: str) -> bool:
    """Whether sympy is allowed to try: at most two unknown letters, no braced or parenthesised or large powers."""
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    return not any(pattern.search(expr) for pattern in _RISKY_POWERS)


@functools.cache
def _sympy_names() -> dict[str, Any]:
    # sympy's public names and no builtins, so the text the model wrote cannot call into Python.
    return {"__builtins__": {}, **{k: v for k, v in vars(sympy).items() if not k.startswith("_")}}


def _sympy_equal(truth: str, given: str) -> bool:
    expr = f"({truth})-({given})"
    if not _sympy_may_evaluate(expr):
        return False
    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        parsed = sympy_parser.parse_expr(expr.replace("^", "**"), local_dict={}, global_dict=_sympy_names(),
                                         transformations=transformations)
        return sympy.simplify(parsed) == 0
    except Exception:  # unparseable or unsimplifiable text is simply not equal (as the grader rules)
        return False


def prm800k_equal(given: str, truth: str | None) -> bool:
    """The PRM800K grader: normalised text equal, else element by element (fractions and integers as text)."""
    truth_norm, given_norm = prm800k_normalize(truth), prm800k_normalize(given)
    if truth_norm is None:
        return False
    if truth_norm == given_norm:
        return True
    if not given_norm:
        return False
    truth_elems, given_elems = _elements(truth_norm), _elements(given_norm)
    if len(truth_elems) > 1 and (truth_norm[0] != given_norm[0] or truth_norm[-1] != given_norm[-1]):
        return False  # a tuple against an interval, or open against closed
    if len(truth_elems) != len(given_elems):
        return False
    for truth_elem, given_elem in zip(truth_elems, given_elems, strict=True):
        if _FRACTION.search(truth_elem) and _FRACTION.search(given_elem):
            same = truth_elem == given_elem  # an unreduced fraction is not the answer
        elif _text_is_int(truth_elem) != _text_is_int(given_elem):
            same = False  # an integer answer must be matched exactly
        else:
            same = _sympy_equal(truth_elem, given_elem)
        if not same:
            return False
    return True


def grade(given: str, truth: str | None) -> bool:
    """Whether `given` (a bare answer) is `truth`: Hendrycks-normalised text equal, or the PRM800K grader says so."""
    return hendrycks_equal(given, truth) or prm800k_equal(given, truth)


# --- DAPO / Minerva ----------------------------------------------------------------------------------------------

_MINERVA_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                          ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
    "<|im_end|>", "<|endoftext|>",
)
_MINERVA_REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep the first $...$ only
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrt2 -> \sqrt{2}
)


def minerva_normalize(answer: Any) -> str:
    """The Minerva normalisation DAPO applies to both its extracted answer and the label."""
    text = str(answer).split("=")[-1]
    for old, new in _MINERVA_SUBSTITUTIONS:
        text = text.replace(old, new)
    for removed in _MINERVA_REMOVED:
        text = text.replace(removed, "")
    for pattern, replacement in _MINERVA_REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()
