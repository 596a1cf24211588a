"""The seed's RL loop, as written, run as one job in its own process.

Target and job id come from the environment (TIMESLICE_TARGET, TIMESLICE_JOB_ID);
argv[1] picks the spelling of the constructor ("ts": TimeSliceOrchestratorClient
with an explicit target, "oc": OrchestratorClient with an explicit job id).
Every critical section appends (job, group, token, start, end) to $SEED_LOG.
"""
import json
import os
import sys
import time

from timeslice import OrchestratorClient, TimeSliceOrchestratorClient

if sys.argv[1] == "ts":
    orchestrator = TimeSliceOrchestratorClient(target=os.environ["TIMESLICE_TARGET"])
else:
    orchestrator = OrchestratorClient(job_id=os.environ["TIMESLICE_JOB_ID"])
ITERATIONS = int(os.environ.get("SEED_ITERATIONS", "4"))


def record(group: str, start: float, end: float) -> None:
    token = orchestrator.held[group].token
    line = json.dumps({"job": orchestrator.job_id, "group": group, "token": token, "start": start, "end": end})
    fd = os.open(os.environ["SEED_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())      # one O_APPEND write per line: never interleaved
    finally:
        os.close(fd)


@orchestrator.on_accelerators(group_id="sampler-group")
def generate(prompts):
    start = time.monotonic()
    time.sleep(0.05)                              # "GPU" work
    samples = [p[::-1] for p in prompts]
    record("sampler-group", start, time.monotonic())
    return samples


def compute_rewards(samples):
    return [sum(map(ord, s)) % 7 for s in samples]   # CPU only: no group held


@orchestrator.on_accelerators(group_id="trainer-group")
def train(samples, rewards):
    start = time.monotonic()
    time.sleep(0.05)
    record("trainer-group", start, time.monotonic())
    return sum(rewards)


prompts = ["alpha", "beta", "gamma"]
for step in range(ITERATIONS):
    samples = generate(prompts)
    rewards = compute_rewards(samples)
    train(samples, rewards)

orchestrator.close()
print("SEED_DONE", orchestrator.job_id, flush=True)
