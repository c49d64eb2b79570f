//! The outcome model: what each signal action says about an output.
