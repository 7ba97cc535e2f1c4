"""Module state one test pollutes and a dozen others clean up, as in problem 7 of issue 10."""

CACHE = {"mode": "default"}
