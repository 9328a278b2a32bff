"""`python -m demo`: a real sidecar and a real 2-rank torchrun job on this machine; one rank
hangs, the sidecar detects it, saves its stacks, kills the group, torchrun restarts it and the
trainer resumes from its checkpoint. What it starts comes from harness/."""
