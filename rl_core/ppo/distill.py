"""On-policy distillation: a frozen teacher's logprob of every token the student sampled, and the per-token
advantage it gives (docs/algorithms.md, "On-policy distillation").

The student samples; the teacher scores each sampled token; `log pi_teacher(a) - log pi_student(a)` is minus
the one-sample estimate of the reverse KL at that token, so adding it to the token's advantage pulls the
student towards the teacher exactly where it went wrong, with a signal on every token. The teacher sits
beside the trainer (`distill.teacher_path`: sharded on every rank like the reference, see `PPOModels`) or
behind a server the user runs (`distill.teacher_url`: `RemoteTeacher` below). Both give the teacher's own
distribution (temperature 1), as SGLang reports input logprobs from raw logits.
"""

from __future__ import annotations

import asyncio

import torch

from rl_core.distributed import broadcast_object, on_rank0
from rl_core.errors import JobError
from rl_core.ppo import algorithms as alg
from rl_core.ppo.config import DistillConfig
from workers.engines.client import EngineClient, EngineError, EngineTimeout


class TeacherError(JobError):
    """A teacher that cannot score the student's tokens (another tokenizer, a server that does not answer)."""


def distill_advantages(reward_advantages: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor,
                       mask: torch.Tensor, cfg: DistillConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """`reward_coef * A_reward + coef * (log pi_teacher - log pi_student)` on every action token (`mask`), and the
    step's `distill/*` metrics. `student` is pi_old's logprob of each sampled token (the policy that sampled it)."""
    reverse_kl = (student - teacher) * mask  # one-sample estimate of KL(student || teacher) at each token
    advantages = cfg.reward_coef * reward_advantages - cfg.coef * reverse_kl
    stats = {"distill/reverse_kl": alg.masked_mean(reverse_kl, mask).item(),
             "distill/teacher_logprob": alg.masked_mean(teacher, mask).item()}
    return advantages * mask, stats


class RemoteTeacher:
    """The teacher behind an SGLang-API server: rank 0 sends each sequence's real tokens to `/generate` with
    `max_new_tokens: 0` and `logprob_start_len: 0` and reads `input_token_logprobs`; every rank gets the
    `[N, T]` result. Like the environments, only rank 0 talks to it."""

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.calls = 0  # names each rank-0 wait (the same count on every rank)

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Collective: the teacher's logprob of every action token of `batch`'s rows, 0 elsewhere."""
        self.calls += 1
        rows = on_rank0(lambda: asyncio.run(self._ask(batch)), f"teacher logprobs {self.calls}")
        return broadcast_object(rows)

    async def _ask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        real = batch["attention_mask"].bool()  # a left-padded query's [PAD]s never reach an engine
        async with EngineClient(self.url, timeout_s=self.timeout_s, label="teacher") as client:
            answers = await asyncio.gather(*(
                teacher_input_logprobs(client, batch["input_ids"][row][real[row]].tolist())
                for row in range(out.shape[0])))
        for row, logprobs in enumerate(answers):
            positions = real[row].nonzero().flatten()
            out[row, positions[1:]] = torch.tensor(logprobs, dtype=torch.float32)
        return out * batch["action_mask"]

    def check(self) -> None:
        """One line when the server does not answer, before any step runs (rank 0)."""
        async def ask() -> None:
            async with EngineClient(self.url, timeout_s=self.timeout_s, label="teacher") as client:
                await client.model_info()
        try:
            asyncio.run(ask())
        except (EngineError, EngineTimeout) as err:
            raise TeacherError(f"distill.teacher_url={self.url} does not answer ({err}); start the teacher's "
                               "server (SGLang's HTTP API) there, or set distill.teacher_url=null") from None


async def teacher_input_logprobs(client: EngineClient, input_ids: list[int]) -> list[float]:
    """The server's logprob of each token of `input_ids` after the first (a prefill, nothing generated)."""
    logprobs = await client.prompt_logprobs(input_ids)
    if logprobs is None:
        raise TeacherError(f"the teacher at {client.base_url} did not answer a logprob for each of the {len(input_ids)} "
                           "tokens of a sequence; it must serve the student's vocabulary")
    return logprobs


def check_same_tokenizer(student, teacher, student_path: str, teacher_path: str) -> None:
    """Per-token logprobs compare only over one vocabulary: the teacher's tokenizer must map every token and
    special token as the student's does."""
    differences = []
    if student.get_vocab() != teacher.get_vocab():
        only = set(student.get_vocab().items()) ^ set(teacher.get_vocab().items())
        differences.append(f"vocabularies of {len(student)} and {len(teacher)} tokens differ in {len(only)} entries")
    for name in ("eos_token_id", "bos_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            differences.append(f"{name} {getattr(student, name)} vs {getattr(teacher, name)}")
    if differences:
        raise TeacherError(f"distill.teacher_path={teacher_path} has another tokenizer than the student "
                           f"model.path={student_path} ({'; '.join(differences)}); on-policy distillation needs "
                           "the same tokenizer: pick a teacher of the student's family")
