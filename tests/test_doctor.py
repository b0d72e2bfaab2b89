"""`routeformer doctor` runs, exits 0 and names the machine's parts and every mechanism."""

from routeformer.attention import list_attentions
from routeformer.cli import main


def test_doctor_names_the_machine_and_every_mechanism(capsys):
    assert main(["doctor", "--length", "40"]) == 0
    out = capsys.readouterr().out
    for part in ("C compiler:", "CPU:", "native kernels:", "triton:", "CUDA:", "topk dense below: 256"):
        assert part in out, part
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert set(list_attentions()) <= listed
    assert "failed:" not in out
