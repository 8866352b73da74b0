"""What a compile does to the Python process around it: the garbage collector, what
dependencies print, which paths can be written."""
