"""Heads that learn the traffic they serve: adaptation rounds on captured requests, judged against the
deployed head and published atomically (``draftsmith-adapt``), and the same learning between requests
of a stream (``eval/run.py --adapt``)."""
