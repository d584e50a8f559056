//! Errors across process boundaries: an [`ErrorKind`] travels as `ErrorInfo` in the details of
//! a gRPC status, so callers branch on the kind, never on message text. This module is the one
//! place where kinds map to gRPC codes.

use prost::Message;
use tonic::{Code, Status};

use crate::v1::{ErrorInfo, ErrorKind};

/// The gRPC code used for each kind.
pub fn code_for(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::Overloaded => Code::ResourceExhausted,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Cancelled => Code::Cancelled,
        ErrorKind::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::LayoutMismatch => Code::FailedPrecondition,
        ErrorKind::TransferFailed => Code::DataLoss,
        ErrorKind::Unauthenticated => Code::Unauthenticated,
        ErrorKind::Internal | ErrorKind::Unspecified => Code::Internal,
    }
}

/// The kind implied by a bare gRPC code (a status without `ErrorInfo`, e.g. from the transport).
pub fn kind_for_code(code: Code) -> ErrorKind {
    match code {
        Code::InvalidArgument | Code::OutOfRange => ErrorKind::InvalidArgument,
        Code::ResourceExhausted => ErrorKind::Overloaded,
        Code::Unavailable | Code::Aborted => ErrorKind::Unavailable,
        Code::Cancelled => ErrorKind::Cancelled,
        Code::DeadlineExceeded => ErrorKind::DeadlineExceeded,
        Code::NotFound => ErrorKind::NotFound,
        Code::FailedPrecondition => ErrorKind::LayoutMismatch,
        Code::DataLoss => ErrorKind::TransferFailed,
        Code::Unauthenticated | Code::PermissionDenied => ErrorKind::Unauthenticated,
        _ => ErrorKind::Internal,
    }
}

/// Builds a status carrying `info` in its details.
pub fn to_status(info: &ErrorInfo) -> Status {
    let kind = ErrorKind::try_from(info.kind).unwrap_or(ErrorKind::Internal);
    Status::with_details(
        code_for(kind),
        info.message.clone(),
        bytes::Bytes::from(info.encode_to_vec()),
    )
}

/// Recovers the structured error from a status; statuses without details (transport errors,
/// other servers) get the kind implied by their code.
pub fn from_status(status: &Status) -> ErrorInfo {
    if !status.details().is_empty()
        && let Ok(info) = ErrorInfo::decode(status.details())
    {
        return info;
    }
    ErrorInfo {
        kind: kind_for_code(status.code()).into(),
        message: status.message().to_owned(),
        worker_id: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [ErrorKind; 11] = [
        ErrorKind::Unspecified,
        ErrorKind::InvalidArgument,
        ErrorKind::Overloaded,
        ErrorKind::Unavailable,
        ErrorKind::Cancelled,
        ErrorKind::DeadlineExceeded,
        ErrorKind::NotFound,
        ErrorKind::LayoutMismatch,
        ErrorKind::TransferFailed,
        ErrorKind::Unauthenticated,
        ErrorKind::Internal,
    ];

    #[test]
    fn every_kind_survives_a_status() {
        for kind in ALL {
            let info = ErrorInfo {
                kind: kind.into(),
                message: format!("{kind:?} happened"),
                worker_id: "w1".into(),
            };
            let back = from_status(&to_status(&info));
            assert_eq!(back, info);
        }
    }

    #[test]
    fn bare_codes_map_back_to_their_kind() {
        for kind in ALL {
            if kind == ErrorKind::Unspecified {
                continue;
            }
            assert_eq!(kind_for_code(code_for(kind)), kind, "{kind:?}");
            let bare = Status::new(code_for(kind), "bare");
            assert_eq!(from_status(&bare).kind, i32::from(kind));
        }
    }
}
