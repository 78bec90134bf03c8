"""``2d``: SUMMA tensor parallelism on a q×q grid."""
