"""A multi-turn, tool-using arithmetic env with a rule-based reward.

The policy is asked to compute an expression. Each turn it may call the calculator with
`<calc>2+3</calc>` or finish with `<answer>5</answer>`. Reward 1 for a correct final answer,
else 0; the episode also ends after `max_turns` actions.

It exercises both multi-turn cases of the trajectory builder on purpose:
  * append: the reply `<result>5</result>` is added after the state and the action, so the next
    state extends the previous one (same sequence);
  * fresh state: on every `summarize_every`-th tool call, or when the appended state would pass
    `max_state_chars`, the env instead returns a short summary ("Q ... Known: 2+3=5.") that is
    not an extension, so the trajectory continues in a new sequence.
Arithmetic is evaluated by walking the AST (no `eval`); everything is deterministic in the sample.
"""

from __future__ import annotations

import ast
import operator
import re

from envs.base import Action, Env, StepResult

CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)

BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow}
UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30


def safe_eval(expression: str) -> int | float:
    """Evaluate + - * / // % ** on numbers by walking the AST; anything else raises ValueError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from err
    return _eval_node(tree.body)


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPS:
        return UNARY_OPS[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} too large (limit {MAX_EXPONENT})")
        try:
            value = BINARY_OPS[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as err:
            raise ValueError(str(err)) from err
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"unsupported syntax {type(node).__name__}: only numbers and + - * / // % ** are allowed")


def format_number(value: int | float) -> str:
    """Integers print as integers (2.0 -> '2'), other floats with up to 6 decimals."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


class CalculatorEnv(Env):
    """Arithmetic questions with a `<calc>` tool; reward 1 for a correct `<answer>`."""

    def __init__(self, max_turns: int = 4, summarize_every: int = 2, max_state_chars: int = 2000,
                 question_template: str = "Compute {expression}. Use <calc>expr</calc> for arithmetic "
                                          "and reply <answer>N</answer>.\n",
                 summary_template: str = "{question}Known: {facts}.\n",
                 nudge: str = "\nUse <calc>expr</calc> or <answer>N</answer>.\n",
                 summary_facts: int = 4):
        if max_turns < 1:
            raise ValueError(f"CalculatorEnv: max_turns must be >= 1, got {max_turns}")
        if summarize_every < 0:
            raise ValueError(f"CalculatorEnv: summarize_every must be >= 0 (0 = never), got {summarize_every}")
        self.max_turns = max_turns
        self.summarize_every = summarize_every
        self.max_state_chars = max_state_chars
        self.question_template = question_template
        self.summary_template = summary_template
        self.nudge = nudge
        self.summary_facts = summary_facts
        self._start("", 0)

    def _start(self, question: str, answer: int | float) -> None:
        self.question, self.answer = question, answer
        self.state = question
        self.facts: list[str] = []
        self.turns = 0
        self.tool_calls = 0

    async def reset(self, sample: dict) -> str:
        if "expression" not in sample:
            raise KeyError(f"CalculatorEnv needs an 'expression' in each sample, got keys {sorted(sample)}")
        expression = str(sample["expression"])
        answer = sample["answer"] if "answer" in sample else safe_eval(expression)
        self._start(self.question_template.format(expression=expression), answer)
        return self.state

    async def step(self, action: Action) -> StepResult:
        self.turns += 1
        answer = ANSWER.search(action.text)
        if answer is not None:
            correct = _matches(answer.group(1), self.answer)
            return StepResult(None, 1.0 if correct else 0.0, True, {"correct": correct, "turns": self.turns})
        if self.turns >= self.max_turns:
            return StepResult(None, 0.0, True, {"correct": False, "turns": self.turns, "out_of_turns": True})
        call = CALC.search(action.text)
        reply = self._run_tool(call.group(1)) if call else self.nudge
        appended = self.state + action.text + reply
        summarize = call is not None and self.summarize_every and self.tool_calls % self.summarize_every == 0
        self.state = self._summary() if summarize or len(appended) > self.max_state_chars else appended
        return StepResult(self.state, 0.0, False, {"tool_calls": self.tool_calls})

    def _run_tool(self, expression: str) -> str:
        self.tool_calls += 1
        try:
            result = format_number(safe_eval(expression))
        except ValueError as err:
            return f"<result>error: {err}</result>\n"
        self.facts.append(f"{expression.strip()}={result}")
        return f"<result>{result}</result>\n"

    def _summary(self) -> str:
        """A fresh, short state (not an extension of the old one): the question and recent results."""
        facts = "; ".join(self.facts[-self.summary_facts:]) or "nothing yet"
        return self.summary_template.format(question=self.question, facts=facts)


def _matches(text: str, answer: int | float) -> bool:
    try:
        return abs(float(text) - float(answer)) < 1e-6
    except ValueError:
        return False
