//! Statistics for recommendations: intervals and comparisons that decide when evidence is enough.
