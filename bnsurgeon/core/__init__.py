"""The bottom layer every stage may use and that uses none of them: errors, BN anatomy, module copies,
text layout, signals, running a model for a check, importing code the user named."""
