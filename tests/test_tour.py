"""The README's five-minute tour runs as a user runs it (tests/tour.py: the block itself, on
tiny settings): it trains, exports, serves, answers the `openai` client (a completion and a
chat) and curl, stops the server and evaluates."""

from __future__ import annotations

import json
import re


def test_the_readme_tour_trains_exports_serves_answers_and_evaluates(readme_tour):
    status, stdout, stderr = readme_tour.finished()
    log = f"stdout:\n{stdout[-6000:]}\nstderr:\n{stderr[-6000:]}"
    root = readme_tour.root
    assert status == 0, log
    assert "greedy sample (" in stdout, log  # train.main finished its run and sampled
    assert (root / "exported/small/config.json").is_file(), log
    # curl's answer: the OpenAI completion object of the served export, named after its folder
    answer = json.loads(re.search(r'\{"id":.*"object":"text_completion".*\}', stdout)[0])
    assert answer["model"] == "small" and answer["usage"]["completion_tokens"] == 16, log
    # the openai client's completion and chat replies were printed between the export's line
    # and curl's JSON (the chat would have stopped the tour with a 400 without a chat template)
    between = stdout.split("exported step 4 of", 1)[1].split('{"id":', 1)[0]
    assert len(between.splitlines()) >= 2, log
    assert (root / "exported/small/chat_template.jinja").is_file(), log
    # train.eval's report of the run's held-out files, at the step it trained
    report = json.loads((root / "runs/default/eval/ppl-step4.json").read_text())
    assert report["task"] == "ppl" and report["step"] == 4, log
