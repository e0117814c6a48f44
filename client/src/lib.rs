//! `allot-client`: the library platform services embed to talk to allot, and the
//! home of `allotctl`. Empty until the client issue lands.
