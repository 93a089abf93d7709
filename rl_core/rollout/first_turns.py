"""A batch's first turns go to the engines together, a group's as one /generate call.

Trajectories launched together (a rollout's batch, a refill of dynamic sampling) each ask for
their first action at their own moment: after an env lease and a reset. Sent one by one, 256
requests reach an engine over several scheduler iterations, so its first prefill holds a few of
them and the decode batch ramps up over many steps (the rollout "trickles"). Here a trajectory's
first /generate waits until every member of its wave has asked or left, then the wave goes out
at once, and unseeded requests with the same input ids and sampling settings (a GRPO group) become
one call with `n = k` (SGLang's parallel sampling), which the router sends to one engine like the
k single requests it replaces.

A request with its own `sampling_seed` goes out alone (with the rest of its wave): n copies of one
request share its seed (identical samples wherever seeds are honoured: the embedded engine, SGLang
under --enable-deterministic-inference), and the router takes one sampling dict per call, so a batch
cannot carry a seed per row. Later turns, and a first turn retried after an abort, go out on their own.
"""

from __future__ import annotations

import asyncio
from typing import Any


class FirstTurnWave:
    """The first /generate of `members` trajectories; each takes a `Seat` and either asks or leaves."""

    def __init__(self, client: Any, members: int):
        self.client = client
        self.waiting_for = members
        self.asked: list[tuple[list[int], dict, str, asyncio.Future, list | None]] = []
        self.calls_sent = 0
        self.sequences_sent = 0
        self._sending: set[asyncio.Task] = set()

    def seat(self) -> "Seat":
        return Seat(self)

    async def _ask(self, input_ids: list[int], params: dict, rid: str, image_data: list | None) -> dict:
        answer = asyncio.get_running_loop().create_future()
        self.asked.append((input_ids, params, rid, answer, image_data))
        self._one_fewer()
        return await answer

    def _one_fewer(self) -> None:
        self.waiting_for -= 1
        if self.waiting_for == 0 and self.asked:
            asked, self.asked = self.asked, []
            task = asyncio.ensure_future(self._send(asked))
            self._sending.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(self._sending.discard)

    async def _send(self, asked: list) -> None:
        groups: dict[tuple, list] = {}
        for item in asked:
            input_ids, params, rid, _, image_data = item
            alone = "sampling_seed" in params  # a group shares its images too (the same prompt's)
            key = (tuple(input_ids), repr(sorted(params.items())), tuple(image_data or ()))
            groups.setdefault(rid if alone else key, []).append(item)
        self.calls_sent += len(groups)
        self.sequences_sent += len(asked)
        await asyncio.gather(*(self._send_group(group) for group in groups.values()))

    async def _send_group(self, group: list) -> None:
        input_ids, params, rid, _, image_data = group[0]
        futures = [item[3] for item in group]
        images = {"image_data": image_data} if image_data else {}  # a text prompt's call is unchanged
        try:
            if len(group) == 1:
                answers = [await self.client.generate(input_ids, params, return_logprob=True, rid=rid, **images)]
            else:  # SGLang replaces the rids of an n > 1 request by its own
                answers = await self.client.generate(input_ids, dict(params, n=len(group)), return_logprob=True,
                                                     **images)
            if not isinstance(answers, list) or len(answers) != len(group):
                raise RuntimeError(f"a grouped /generate of {len(group)} sequences answered with "
                                   f"{len(answers) if isinstance(answers, list) else 'one'}")
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            raise
        except Exception as err:  # each member's trajectory raises it, as its own call would have
            for future in futures:
                if not future.done():
                    future.set_exception(err)
            return
        for future, answer in zip(futures, answers):
            if not future.done():  # its trajectory may have been cancelled meanwhile
                future.set_result(answer)


class Seat:
    """One trajectory's place in a wave: its first /generate goes through the wave, exactly once."""

    def __init__(self, wave: FirstTurnWave):
        self.wave: FirstTurnWave | None = wave

    @property
    def open(self) -> bool:
        return self.wave is not None

    async def generate(self, input_ids: list[int], params: dict, rid: str, image_data: list | None = None) -> dict:
        wave, self.wave = self.wave, None
        return await wave._ask(input_ids, params, rid, image_data)

    def leave(self) -> None:
        """The trajectory ends, or waits for an env, without asking: the wave no longer waits for it."""
        wave, self.wave = self.wave, None
        if wave is not None:
            wave._one_fewer()
