"""A user agent loop, loaded by tests as `rollout.agent=agent_example:Recheck`."""

from tandem.agent import AgentLoop
from tandem.sample import Status

PROMPT_AGAIN = "<again>"


class Recheck(AgentLoop):
    """Two turns: after the model's first answer it is shown `<again>` (context, never trained on)
    and answers once more. The turn an episode is in is in its sample (`agent_stats["turns"]`)."""

    def run(self, turn, samples, params):
        for s in samples:
            s.agent_stats.setdefault("turns", 1.0)
        first = [s for s in samples if s.agent_stats["turns"] == 1.0 and s.status is not Status.FINISHED]
        turn(first, params)
        second = [s for s in first if s.status is Status.FINISHED and s.finish_reason == "stop"]
        for s in second:
            s.extend_context(self.tokenizer.encode(PROMPT_AGAIN, add_special_tokens=False))
            s.agent_stats["turns"] = 2.0
            s.status = Status.RUNNING
        second += [s for s in samples if s.agent_stats["turns"] == 2.0 and s.status is Status.ABORTED]
        turn(second, params)
        return samples
