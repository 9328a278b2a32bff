"""A Slurm job's owner labels (issue 44, docs/security.md "What a rank may claim about itself"): an
unprivileged user's rank is labelled with her own name, whatever it claims; the account and partition
it sends label only her own job; a `slurm.user`, or a value that is no Slurm name, is refused with 400
naming the field, and the sidecar answers on. Each attack runs as an unprivileged user against a real
root sidecar."""

from __future__ import annotations

from tests.security.rig import attack, open_sidecar, ranks_of, start_as
from tests.support import kill_tree, wait_until
from tests.support.unpriv import unprivileged_user

MALLORY_RANK = """
    rank = sleeper()
    refused = [request("/v1/register", registration(rank.pid, "mine", slurm=slurm))[1]
               for slurm in ({"user": "sidecar-t-alice"}, {"account": "x" * 65}, {"partition": "gpu\\n"},
                             {"account": 1e308}, [1, 2])]
    status, body = request("/v1/register", registration(rank.pid, "mine", slurm={"account": "alices-acct",
                                                                                 "partition": "gpu"}))
    report(refused=refused, status=status, body=body)
    time.sleep(600)
"""


def test_a_user_cannot_name_another_user_and_her_claims_label_only_her_own_job():
    alice, mallory = unprivileged_user("alice"), unprivileged_user("mallory")
    with open_sidecar() as sidecar:
        victim, _ = start_as(
            alice,
            sidecar,
            """
            rank = sleeper()
            status, body = request("/v1/register", registration(rank.pid, "victim", slurm={"account": "alices-acct"}))
            assert status == 200, body
            report(pid=rank.pid)
            time.sleep(600)
            """,
        )
        proc, out = start_as(mallory, sidecar, MALLORY_RANK)
        try:
            assert out["status"] == 200, out["body"]
            codes = [(body["code"], body["error"].split(":")[0]) for body in out["refused"]]
            assert codes == [("bad_field", "slurm"), ("bad_field", "slurm.account"),
                             ("bad_field", "slurm.partition"), ("bad_field", "slurm.account"),
                             ("bad_field", "slurm")]  # fmt: skip
            assert "the user is the uid of the process" in out["refused"][0]["error"]
            mine, theirs = ranks_of(sidecar, "mine")[0], ranks_of(sidecar, "victim")[0]
            assert mine["uid"] == mallory.uid and mine["slurm"] == {
                "user": mallory.name, "account": "alices-acct", "partition": "gpu"
            }  # fmt: skip
            assert theirs["slurm"] == {"user": alice.name, "account": "alices-acct"}  # untouched

            def series() -> list[str]:
                return [line for line in sidecar.metrics().splitlines()
                        if line.startswith("sidecar_rank_state{") and 'job_id="' in line]  # fmt: skip

            wait_until(lambda: len(series()) >= 2, 30, what="both jobs' rank series")
            for line in series():
                owner = mallory.name if 'job_id="mine"' in line else alice.name
                assert f'slurm_user="{owner}"' in line, line
            assert sidecar.status()["ranks"]  # the sidecar answers on
        finally:
            kill_tree(proc)
            kill_tree(victim)


def test_a_malformed_slurm_object_from_an_unprivileged_user_never_stops_the_sidecar():
    mallory = unprivileged_user("mallory")
    with open_sidecar() as sidecar:
        out = attack(
            mallory,
            sidecar,
            """
            rank = sleeper()
            answers = []
            for slurm in ({"account": "a" * 100000}, {"account": None, "partition": {"x": [1] * 1000}},
                          {"\\u0000": "x"}, {"account": "gpu\\u202e"}, "x" * 1000, 7, True):
                answers.append(request("/v1/register", registration(rank.pid, "mine", slurm=slurm)))
            rank.kill()
            report(answers=answers)
            """,
        )
        assert [status for status, _ in out["answers"]] == [400] * 7, out
        assert all(body["code"] == "bad_field" and body["error"].startswith("slurm") for _, body in out["answers"])
        assert all(len(body["error"]) < 300 for _, body in out["answers"])  # the error quotes a bounded part
        assert sidecar.status()["ranks"] == []
