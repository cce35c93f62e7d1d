"""The multi-turn episodes of a replay (runtime/replay.py): the environments are not asked, their answers
come from the run's record, each applied after the decode call the run applied it after.

A run's environments answer on their own threads and their answers land whenever they land: which decode
call a parked slot resumes at is timing's choice, and the answer itself may be the outside world's (a
clock, a timeout, randomness). The actor's recorder (`schedule_log.ActorSchedule.answered`) writes each
answer with the CRC of the turn it answered; here the same answers are applied at the same places, and
each turn is checked against the run's CRC before its answer is applied.
"""

from __future__ import annotations

from jaxrl_async.envs.driver import EpisodeDriver
from jaxrl_async.envs.env import StepResult
from jaxrl_async.runtime.schedule_log import last_turn, token_crc

# `_Running.future` of an episode whose turn ended and whose answer the record has not yet given.
_AWAITING = object()


class AnswerMissing(Exception):
    """A recorded answer is for an episode that has no turn waiting for it here (the rollouts differ);
    args: (message, (group, sample))."""


class RecordedAnswers(EpisodeDriver):
    """An `EpisodeDriver` whose environments are the record: `step` decodes and parks the turns that end,
    `answer` applies one recorded answer."""

    def __init__(self, loop, cfg, tokenizer):
        super().__init__(loop, cfg, tokenizer, make_env=lambda row: None, workers=1)

    def step(self) -> list:
        for c in self.loop.step():
            run = self._running[(c.uid, c.sample_index)]
            run.episode.add_turn(c.tokens, c.logprobs, c.versions)
            run.future = _AWAITING
        return []  # an episode ends only with an answer (`answer`)

    def answer(self, rec: list):
        """Applies one recorded answer [group, sample, turn CRC, observation, reward(, reason)]; returns
        (the episode, whether its turn is the run's, whether it ended).

        Raises:
          AnswerMissing: no turn of that episode waits for an answer.
        """
        gid, sample, crc, observation, reward, *reason = rec
        key = (gid, sample)
        run = self._running.get(key)
        if run is None or run.future is not _AWAITING:
            raise AnswerMissing(f"the run's answer to episode {key} has no turn here that waits for it", key)
        run.future = None
        episode = run.episode
        same = token_crc(last_turn(episode)) == crc
        result = StepResult(observation, reward, bool(reason), {"reason": reason[0]} if reason else {})
        return episode, same, self.apply(key, result)


class ReplayEpisodes:
    """G episodes per granted prompt, their answers from the record (`EpisodeRunner`'s part in a replay).

    Args:
      cfg: the run's EnvConfig.
      loop: the replay's SamplerLoop.
      tokenizer: encodes text observations, as the run's driver did.
    """

    def __init__(self, cfg, loop, tokenizer):
        self.driver = RecordedAnswers(loop, cfg, tokenizer)
        self._prompts: dict[int, list] = {}  # group id -> [its Prompt, episodes not yet ended]

    def add_request(self, request) -> None:
        self._prompts[int(request.uid)] = [request.metadata, request.n_samples]
        self.driver.add(request.uid, request.metadata, request.prompt_tokens, request.n_samples, request.seed)

    def step(self) -> None:
        self.driver.step()

    def answers(self, recs: list) -> tuple[list, list]:
        """Applies one call's recorded answers, in the run's order: ([(Episode, Prompt)] of the episodes
        that ended, [(group, sample)] of the turns that differ from the run's)."""
        ended, differ = [], []
        for rec in recs:
            episode, same, done = self.driver.answer(rec)
            if not same:
                differ.append((int(episode.uid), int(episode.sample_index)))
            if done:
                entry = self._prompts[int(episode.uid)]
                entry[1] -= 1
                if not entry[1]:
                    del self._prompts[int(episode.uid)]
                ended.append((episode, entry[0]))
        return ended, differ

    def close(self) -> None:
        self.driver.close()
