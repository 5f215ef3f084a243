"""gcshadow, the server at home: receives the jobs' output into files under its
root, durably, serves their stdin, and shows them (tail, web)."""
