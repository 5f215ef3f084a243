from .entry import gcwrap

gcwrap()
