"""How the launcher relays the ranks' lines and progress bars (src/ringtrain/launch/rank_output.py)."""

from __future__ import annotations

import io

from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions
from ringtrain.launch.rank_output import RankOutput


def _output() -> tuple[RankOutput, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    options = LaunchOptions(np=2, hosts=(Host("localhost", 2),), command=("python",))
    return RankOutput(options, out, err), out, err


def test_a_rank_s_own_bar_and_lines_pass_as_written() -> None:
    output, _, err = _output()
    output.print_line(0, 2, " 10%|#", "\r")
    output.print_line(0, 2, " 20%|##", "\r")
    output.print_line(0, 2, "100%|##########", "\n")  # tqdm's close: the last state, a newline
    assert err.getvalue() == "[0]  10%|#\r[0]  20%|##\r[0] 100%|##########\n"


def test_another_rank_s_line_does_not_start_over_an_open_bar() -> None:
    # A tqdm bar on rank 0 (redrawn with "\r"), then a log line from rank 1: written after the
    # "\r" it overwrote the bar, the bar's tail showing after it ("[1] shares [60, 40]9.6it/s]").
    # The bar's line is ended first; its next redraw starts below the line.
    output, out, err = _output()
    output.print_line(0, 2, " 40%|####      | 8/20 [00:00<00:00, 19.6it/s]", "\r")
    output.print_line(1, 2, "shares [60, 40]", "\n")
    output.print_line(0, 2, " 50%|#####     | 10/20", "\r")
    output.print_line(0, 1, "rank 0 on stdout", "\n")  # the same rank's other stream: another
    output.end_bar()  # the launcher's own message (Supervisor.say) comes next
    output.end_bar()  # and nothing is left open to end twice
    assert err.getvalue() == (
        "[0]  40%|####      | 8/20 [00:00<00:00, 19.6it/s]\r\n"
        "[1] shares [60, 40]\n"
        "[0]  50%|#####     | 10/20\r\n"
    )
    assert out.getvalue() == "[0] rank 0 on stdout\n"
