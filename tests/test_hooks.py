"""The chief's checkpoint hook, in one process with a stand-in for the run."""

from dataclasses import dataclass, field
from pathlib import Path

from mpips.hooks import CheckpointSaver, PendingSave, StepInfo
from mpips.layout import Role


@dataclass
class FakeRun:
    """What CheckpointSaver uses of a Run: PS shards that take ``write_polls`` polls."""

    write_polls: int
    step: int = 0
    start_step: int = 0
    save_seconds: float = 0.0
    role: Role = Role("worker", 0)
    is_chief: bool = True
    asked: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)

    def global_step(self) -> int:
        return self.step

    def start_save(self) -> PendingSave:
        step, polls = self.step, [self.write_polls]
        self.asked.append(step)

        def commit(block: bool) -> Path | None:
            polls[0] -= 1
            if polls[0] > 0 and not block:
                return None  # the PS tasks are still writing their shards
            self.committed.append(step)
            return Path(f"ckpt-{step}.json")

        return PendingSave(step, commit)


def test_a_periodic_checkpoint_does_not_stop_the_chief():
    """The chief asks for a checkpoint and goes on training; it commits at a later step,
    once the shards are written; it asks for no second one meanwhile; the end waits."""
    run, saver = FakeRun(write_polls=4), CheckpointSaver(every_steps=10, every_secs=0)
    saver.begin(run)
    for step in range(1, 23):
        run.step = step
        saver.after_step(run, StepInfo(step, 0.1, 0, step))
        if step == 10:
            assert run.asked == [10] and run.committed == []  # asked, not waited for
    assert run.asked == [10, 20] and run.committed == [10]  # 10 committed at step 13
    run.step = 23
    saver.end(run)  # waits for 20's shards, then the final checkpoint at 23
    assert run.asked == [10, 20, 23] and run.committed == [10, 20, 23]
    assert run.save_seconds > 0
