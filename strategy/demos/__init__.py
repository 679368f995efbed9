"""Small tasks the examples and tests share (the toy string-reversal task and its char tokenizer).

May import: ``strategy`` and its subsystems; nothing in ``strategy`` imports from here.
"""
