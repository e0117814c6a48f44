//! The GPU node agent (in progress).
