"""The wire protocol both programs speak: events, frames and their codec, the
sans-I/O connection, authentication, names and compression. It imports
neither side."""
